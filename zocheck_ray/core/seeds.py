"""Perturbation seeds: a step's seed is an unsigned 64-bit integer that the trainer derives from the run's seed and
the step, and its record carries; the generator keys on its two 32-bit words.
"""

from __future__ import annotations

import hashlib

SEED_MAX = 2**64 - 1
MASK32 = 0xFFFFFFFF
"""The low 32-bit word of a seed, or of a counter: `x & MASK32`."""


def check_seed(seed: int) -> int:
    """`seed` when it is an integer in [0, 2**64); else `ValueError` naming it."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return seed


def perturbation_seeds(seed: int, count: int) -> tuple[int, ...]:
    """The seeds of a step's `count` perturbations (n-SPSA): the step's own seed, then SHA-256 of (seed, j) for j = 1 ..
    count-1, so a replay derives them from the record.

    >>> perturbation_seeds(7, 1)
    (7,)"""
    check_seed(seed)
    out = [seed]
    for j in range(1, count):
        digest = hashlib.sha256(f"zo-perturbation:{seed}:{j}".encode()).digest()
        out.append(int.from_bytes(digest[:8], "little"))
    return tuple(out)
