"""Where numba caches the compiled kernels: `NUMBA_CACHE_DIR`, numba's documented setting.

Unset, numba writes beside the source, which an installed package may forbid; so importing
`zocheck_ray` sets it to `$XDG_CACHE_HOME/zocheck-ray/numba` unless the user has.
"""

from __future__ import annotations

import os

CACHE_DIR_ENV = "NUMBA_CACHE_DIR"


def default_cache_dir() -> str:
    """The directory numba caches in where the user has not set `NUMBA_CACHE_DIR`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "zocheck-ray", "numba"))


def use_cache_dir() -> str:
    """Set `NUMBA_CACHE_DIR` to `default_cache_dir()` unless set (numba reads it at import); returns the directory."""
    return os.environ.setdefault(CACHE_DIR_ENV, default_cache_dir())


def cache_env() -> dict[str, str]:
    """`NUMBA_CACHE_DIR` for an actor's `runtime_env["env_vars"]` where it is the user's choice, else {}, so Ray's
    prestarted workers can serve."""
    chosen = use_cache_dir()
    return {} if chosen == default_cache_dir() else {CACHE_DIR_ENV: chosen}
