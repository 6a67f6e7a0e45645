"""Perturbation seeds: what a step's seed may be, and how the generator keys on it.

A seed is an unsigned 64-bit integer; the generator's key is its low and high 32-bit words.
The seed of step t is chosen by the trainer (a pure function of the run's seed and t) and
travels in the step's `StepRecord`.
"""

from __future__ import annotations

SEED_MAX = 2**64 - 1
MASK32 = 0xFFFFFFFF
"""The low 32-bit word of a seed, or of a counter: `x & MASK32`."""


def check_seed(seed: int) -> int:
    """`seed` when it is an integer in [0, 2**64); else `ValueError` naming it."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return seed
