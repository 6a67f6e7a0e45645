"""Device-invariant perturbations: Philox4x32-10 keyed by the step seed, indexed by offset.

z at global offset `i` is a pure function of (seed, i): counter (i >> 2, 0, STREAM, 0) under key
(seed's low word, high word) gives four 32-bit words, and element i takes lane i & 3 of them.
Gaussians come from a Box-Muller transform in float32 `+ - * /` and integer operations only (no
libm, no FMA, each operation rounded on its own), so CPU, CUDA and the fused kernels agree bit for
bit; uniforms are odd multiples of 2**-24, so |z| < 5.78. Rademacher takes the word's top bit.
This torch implementation is the oracle the kernels are tested against.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from zocheck_ray.core.seeds import MASK32, check_seed

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
STREAM = 0x5A4F
"""Third counter word: separates this stream from any future one."""

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


def _f32(x: float) -> float:
    return float(np.float32(x))


# Box-Muller constants, float32 values (fused.py uses the same ones).
LN2 = _f32(math.log(2.0))
SQRT2 = _f32(math.sqrt(2.0))
HALF_PI = _f32(math.pi / 2.0)
TWO_POW_M24 = 2.0**-24
LOG_SERIES = tuple(_f32(2.0 / k) for k in (9, 7, 5, 3))
"""atanh series of log(m), s = (m-1)/(m+1), Horner order."""
SIN_SERIES = tuple(_f32((-1) ** k / math.factorial(2 * k + 1)) for k in (5, 4, 3, 2, 1))
COS_SERIES = tuple(_f32((-1) ** k / math.factorial(2 * k)) for k in (6, 5, 4, 3, 2, 1))
RSQRT_MAGIC = 0x5F375A86
NEWTON_STEPS = 3


def counter_words(seed: int, first: int, count: int, device="cpu") -> torch.Tensor:
    """Philox words for counters first .. first+count-1, as int64 [count, 4]."""
    check_seed(seed)
    ctr = torch.arange(first, first + count, dtype=torch.int64, device=device)
    c2 = torch.full_like(ctr, STREAM)
    c3 = torch.zeros_like(ctr)
    out = philox4x32((ctr & MASK32, ctr >> 32, c2, c3), (seed & MASK32, seed >> 32))
    return torch.stack(out, dim=1)


def unit_uniform(bits23: torch.Tensor) -> torch.Tensor:
    """(2 * bits23 + 1) * 2**-24: an odd multiple of 2**-24 in (0, 1), exact in float32."""
    return (bits23 * 2 + 1).to(torch.float32) * TWO_POW_M24


def log_unit(u: torch.Tensor) -> torch.Tensor:
    """Natural logarithm of normal float32 values in (0, 1)."""
    bits = u.view(torch.int32)
    e = ((bits >> 23) - 127).to(torch.float32)
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)
    big = m > SQRT2
    m = torch.where(big, m * 0.5, m)
    e = torch.where(big, e + 1.0, e)
    t = m - 1.0
    s = t / (t + 2.0)
    s2 = s * s
    acc = torch.full_like(s, LOG_SERIES[0])
    for c in LOG_SERIES[1:]:
        acc = acc * s2 + c
    acc = acc * s2 + 2.0
    return e * LN2 + s * acc


def sqrt_positive(a: torch.Tensor) -> torch.Tensor:
    """sqrt of positive normal float32 values: a * rsqrt(a), by Newton steps."""
    y = (RSQRT_MAGIC - (a.view(torch.int32) >> 1)).view(torch.float32)
    h = a * 0.5
    for _ in range(NEWTON_STEPS):
        y = y * (1.5 - (h * y) * y)
    return a * y


def quarter_sincos(f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sin and cos of f * pi/2 for f in (0, 1)."""
    x = f * HALF_PI
    x2 = x * x
    acc = torch.full_like(x, SIN_SERIES[0])
    for c in SIN_SERIES[1:]:
        acc = acc * x2 + c
    sin = x * (acc * x2 + 1.0)
    acc = torch.full_like(x, COS_SERIES[0])
    for c in COS_SERIES[1:]:
        acc = acc * x2 + c
    cos = acc * x2 + 1.0
    return sin, cos


def box_muller(wa: torch.Tensor, wb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent standard normals from two 32-bit words (int64 tensors)."""
    radius = sqrt_positive(log_unit(unit_uniform(wa >> 9)) * -2.0)
    sin, cos = quarter_sincos(unit_uniform((wb >> 7) & 0x7FFFFF))
    quadrant = wb >> 30
    odd = (quadrant & 1) == 1
    x = torch.where(odd, sin, cos)
    y = torch.where(odd, cos, sin)
    x = torch.where((quadrant == 1) | (quadrant == 2), -x, x)
    y = torch.where(quadrant >= 2, -y, y)
    return radius * x, radius * y


def perturbation(seed: int, offset: int, numel: int, kind: str = "gaussian", device="cpu") -> torch.Tensor:
    """z (float32, 1-D) for `numel` elements starting at global offset `offset`, in eager torch.

    >>> z = perturbation(seed=7, offset=0, numel=10)
    >>> torch.equal(z[4:], perturbation(seed=7, offset=4, numel=6))
    True
    """
    if kind not in ("gaussian", "rademacher"):
        raise ValueError(f"unknown perturbation kind {kind!r}; expected 'gaussian' or 'rademacher'")
    device = torch.device(device)
    if numel == 0:
        return torch.empty(0, dtype=torch.float32, device=device)
    first = offset >> 2
    words = counter_words(seed, first, ((offset + numel - 1) >> 2) - first + 1, device)
    if kind == "gaussian":
        z01 = box_muller(words[:, 0], words[:, 1])
        z23 = box_muller(words[:, 2], words[:, 3])
        z = torch.stack((*z01, *z23), dim=1)
    else:
        one = torch.ones((), dtype=torch.float32, device=device)
        z = torch.where((words >> 31) == 1, -one, one)
    start = offset & 3
    return z.reshape(-1)[start : start + numel]
