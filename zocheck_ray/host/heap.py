"""The cyclic garbage collector around an actor's start-up.

An actor's constructor makes hundreds of thousands of long-lived objects (torch, numba, the model)
that the cyclic collector would walk again and again. So it is paused during the constructor, and
at its end one pass collects and the survivors are frozen out of its reach.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

from zocheck_ray.host.capabilities import capabilities


@contextmanager
def settling_heap():
    """Run the block with the cyclic collector paused; then collect, freeze the survivors and resume it (plain path:
    the block as it is)."""
    if not capabilities().heap_freeze:
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        if was_enabled:
            gc.enable()
