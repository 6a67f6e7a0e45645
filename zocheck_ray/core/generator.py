"""Device-invariant perturbations: Philox4x32-10 keyed by the step seed, indexed by offset.

z for the element at global offset `i` (its position in the canonical parameter
order) is a pure function of (seed, i): counter (i >> 2, 0, STREAM, 0) and key
(seed low word, seed high word) give four 32-bit words, word i & 3 belongs to
element i. A Gaussian turns the word into a value through `normal_table`; a
Rademacher takes its top bit. Only integer operations, one int-to-float conversion
of a value below 2**24, and a float32 multiply and add are used, so every device
and every partitioning gives the same bits.

This module is the torch implementation (any device); it is the oracle that the
fused CPU kernel (`fused.py`) is tested against.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from zocheck_ray.core.normal_table import normal_table

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
STREAM = 0x5A4F
"""Third counter word: separates the perturbation stream from any future stream."""
MASK32 = 0xFFFFFFFF
SEED_MAX = 2**64 - 1

# int64 tensors hold the 32-bit words; 32x32-bit products are split into 16-bit
# halves so no intermediate leaves int64 (signed overflow is not portable).


def _mulhilo(m: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m_hi, m_lo = m >> 16, m & 0xFFFF
    t1 = b * m_lo
    t = b * m_hi + (t1 >> 16)
    return t >> 16, ((t & 0xFFFF) << 16) | (t1 & 0xFFFF)


def philox4x32(counter: tuple, key: tuple[int, int], rounds: int = PHILOX_ROUNDS):
    """Philox4x32-`rounds` on int64 tensors (or ints) holding 32-bit words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return seed


def random_words(seed: int, offset: int, numel: int, device="cpu") -> torch.Tensor:
    """The 32-bit words (as int64) for elements offset .. offset+numel-1."""
    check_seed(seed)
    first, last = offset >> 2, (offset + numel - 1) >> 2
    ctr = torch.arange(first, last + 1, dtype=torch.int64, device=device)
    c0 = ctr & MASK32
    c1 = ctr >> 32
    c2 = torch.full_like(ctr, STREAM)
    c3 = torch.zeros_like(ctr)
    words = torch.stack(philox4x32((c0, c1, c2, c3), (seed & MASK32, seed >> 32)), dim=1)
    start = offset & 3
    return words.reshape(-1)[start : start + numel]


@lru_cache(maxsize=8)
def _device_table(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    nodes, slopes = normal_table()
    return (torch.from_numpy(nodes.copy()).to(device), torch.from_numpy(slopes.copy()).to(device))


def gaussian_from_words(words: torch.Tensor) -> torch.Tensor:
    """Standard normal float32 values from 32-bit words (int64 tensor)."""
    nodes, slopes = _device_table(str(words.device))
    sign = words >> 31
    q = words & 0x7FFFFFFF
    # floor(log2 q) from the float32 exponent of q >> 7 (< 2**24, so exact).
    h = ((q >> 7) | 1).to(torch.float32).view(torch.int32).to(torch.int64)
    octave = torch.clamp((h >> 23) - 127 + 7, min=8)
    shift = octave - 8
    index = 256 * (octave - 7) + (q >> shift) - 256
    rem = q & ((torch.ones_like(shift) << shift) - 1)
    magnitude = nodes[index] + rem.to(torch.float32) * slopes[index]
    return torch.where(sign == 1, -magnitude, magnitude)


def rademacher_from_words(words: torch.Tensor) -> torch.Tensor:
    """+1/-1 float32 values from the top bit of 32-bit words."""
    one = torch.ones((), dtype=torch.float32, device=words.device)
    return torch.where((words >> 31) == 1, -one, one)


def perturbation(seed: int, offset: int, numel: int, kind: str = "gaussian", device="cpu") -> torch.Tensor:
    """z (float32, 1-D) for `numel` elements starting at global offset `offset`.

    >>> z = perturbation(seed=7, offset=0, numel=10)
    >>> torch.equal(z[4:], perturbation(seed=7, offset=4, numel=6))
    True
    """
    if numel == 0:
        return torch.empty(0, dtype=torch.float32, device=device)
    words = random_words(seed, offset, numel, device)
    if kind == "gaussian":
        return gaussian_from_words(words)
    if kind == "rademacher":
        return rademacher_from_words(words)
    raise ValueError(f"unknown perturbation kind {kind!r}; expected 'gaussian' or 'rademacher'")
