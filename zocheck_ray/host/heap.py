"""The cyclic garbage collector around an actor's start-up.

A trainer's or shadow's constructor imports torch, numba and (a trainer) the model's library, and builds
the model: hundreds of thousands of long-lived objects. Python's cyclic collector runs every few hundred
allocations and walks the young objects each time, and the older generations ever more often as they
grow: about a quarter of a trainer's start-up CPU here (5.9 CPU-s with it, 4.5 without, for the default
job). So the collector is paused while the constructor runs (`settling_heap`); at its end one pass
frees the start-up's cyclic garbage and what survives is frozen out of the collector's reach, so that
its later passes walk only what the loops allocate (the shadow once spent a tenth of its CPU in `gc`
walking start-up objects). Reference counting frees everything else (tensors included) as before:
only objects in reference cycles wait for the one pass.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def settling_heap():
    """Run the block (an actor's start-up) with the cyclic collector paused; then free the cyclic garbage it
    made, move what survives (modules, model, kernels: alive as long as the process) out of the collector's
    reach and resume the collector (where it ran before). Also where the block raises."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        if was_enabled:
            gc.enable()
