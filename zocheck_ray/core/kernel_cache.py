"""Where numba caches the compiled replay kernels: `NUMBA_CACHE_DIR`, numba's documented setting.

The kernels are `@njit(cache=True)`. Without the setting numba writes its cache beside the source,
which an installed package may not allow and which a new copy of the sources starts without; so
where the user has not set it, importing `zocheck_ray` sets it to

    $XDG_CACHE_HOME/zocheck-ray/numba, else ~/.cache/zocheck-ray/numba

before numba is imported (numba reads it then), and `compile_kernels`, the tests and every actor on
a machine share one cache. numba keys the cache by the source file's path and modification time: a
fresh clone, or a `ray job submit --working-dir` upload unpacked to a new directory, compiles once.
"""

from __future__ import annotations

import os

CACHE_DIR_ENV = "NUMBA_CACHE_DIR"


def default_cache_dir() -> str:
    """The directory numba caches in where the user has not set `NUMBA_CACHE_DIR`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "zocheck-ray", "numba"))


def use_cache_dir() -> str:
    """Set `NUMBA_CACHE_DIR` to `default_cache_dir()` unless it is set; returns the directory numba caches in.
    numba reads the variable when it is imported: in a process that imported numba first, numba keeps its own."""
    return os.environ.setdefault(CACHE_DIR_ENV, default_cache_dir())


def cache_env() -> dict[str, str]:
    """`NUMBA_CACHE_DIR` for an actor's `runtime_env["env_vars"]` where this process's is the user's choice,
    else {}: a Ray worker's environment is its node's, not the driver's, and the package sets the default
    there from that node's own home directory (a driver's home may not exist on another node). An empty
    `env_vars` also leaves the actors free to take the workers Ray starts ahead for the job."""
    chosen = use_cache_dir()
    return {} if chosen == default_cache_dir() else {CACHE_DIR_ENV: chosen}
