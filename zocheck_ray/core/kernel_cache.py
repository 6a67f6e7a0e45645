"""Where numba keeps the compiled replay kernels: one directory per content of their source file.

numba's own cache sits in `__pycache__` beside the source, so a copy of the package at another path
starts with none, and every process of it compiles the kernels it meets again (tens of seconds of CPU
each): what `ray job submit --working-dir .` makes of every job (the sources are unpacked to a new
directory per upload), a fresh clone, a new container layer. The compiled code depends on the source's
content, numba's and Python's versions and the CPU, not on where the file lies; so the kernels of the
modules in `KERNEL_MODULES` are cached in a directory named by the SHA-256 of their file (numba's index
adds its version, the signatures and the CPU), under

    $ZOCHECK_KERNEL_CACHE, else $XDG_CACHE_HOME/zocheck-ray/kernels, else ~/.cache/zocheck-ray/kernels

and every copy of the same sources on a machine shares them. `NUMBA_CACHE_DIR`, where set, still wins
(numba's locator for it comes first); a cache directory that cannot be written falls back to numba's own.
"""

from __future__ import annotations

import functools
import hashlib
import os

from numba.core import caching

KERNEL_MODULES = frozenset({"zocheck_ray.core.fused"})
"""The modules whose cached functions this locator places."""

CACHE_ENV = "ZOCHECK_KERNEL_CACHE"


def cache_root() -> str:
    """The directory that holds one subdirectory of compiled kernels per source content."""
    if os.environ.get(CACHE_ENV):
        return os.path.abspath(os.path.expanduser(os.environ[CACHE_ENV]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "zocheck-ray", "kernels")


@functools.lru_cache(maxsize=None)
def _source_digest(path: str, mtime_ns: int, size: int) -> str:
    # keyed by (mtime, size) as well, so a file edited while a process runs is hashed again
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def source_digest(path: str) -> str:
    st = os.stat(path)
    return _source_digest(os.path.abspath(path), st.st_mtime_ns, st.st_size)


class ContentKeyedLocator(caching._CacheLocator):
    """numba's cache locator for `KERNEL_MODULES`: `<cache_root()>/<module>-<sha256[:16]>/`, freshness by content."""

    def __init__(self, py_func, py_file: str):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        module = py_func.__module__.rsplit(".", 1)[-1]
        self._cache_path = os.path.join(cache_root(), f"{module}-{source_digest(py_file)[:16]}")

    def get_cache_path(self) -> str:
        return self._cache_path

    def get_source_stamp(self) -> str:
        return source_digest(self._py_file)

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file: str):
        if getattr(py_func, "__module__", None) not in KERNEL_MODULES or not os.path.isfile(py_file):
            return None
        locator = cls(py_func, py_file)
        try:
            locator.ensure_cache_path()
        except OSError:
            return None  # numba's next locator: the in-tree __pycache__
        return locator


def install() -> None:
    """Put `ContentKeyedLocator` before numba's in-tree one (after `NUMBA_CACHE_DIR`'s); idempotent. Call it
    before the module's `@njit(cache=True)` functions are defined: numba picks the locator then."""
    classes = caching.CacheImpl._locator_classes
    if ContentKeyedLocator in classes:
        return
    first = 1 if classes and classes[0] is caching.UserProvidedCacheLocator else 0
    classes.insert(first, ContentKeyedLocator)
