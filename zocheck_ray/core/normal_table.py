"""The inverse-CDF table behind the device-invariant Gaussian.

A Gaussian draw takes one 32-bit word: the top bit is the sign, the other 31 bits
`q` pick the one-sided tail probability x = (q + 0.5) / 2**32 in (0, 1/2), and
|z| = Phi^-1(1 - x). Phi^-1 is read from a table of nodes and linearly interpolated
with two float32 operations, so CPU, CUDA and the fused kernel all compute the same
bits with `+` and `*` alone (no libm).

Nodes are geometric in the tail: q < 512 is looked up exactly; each octave
[2**k, 2**(k+1)), k = 9..30, is split into 256 equal intervals. That keeps the
interpolation error below 1e-6 everywhere while the largest |z| is 6.36.

The node values are computed once with mpmath at 40 digits (platform-independent
arbitrary precision) and shipped as `normal_table.bin`, raw little-endian float32,
guarded by its SHA-256; `tests/test_generator.py` rebuilds it and compares bits.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

import numpy as np

SEGMENT_BITS = 8
"""log2 of the intervals per octave."""
NUM_NODES = 256 * 24 + 1
"""Index a in [0, 6144) addresses an interval; node 6144 closes the last one (q = 2**31)."""
TABLE_FILE = Path(__file__).with_name("normal_table.bin")
TABLE_SHA256 = "9e83723fcbd0363714967e77d2816a2e46bd075754335e786d015fc5b62dbfe8"


def node_q(a: int) -> int:
    """The 31-bit integer q at node a."""
    if a < 512:
        return a
    k = 7 + a // 256
    return (256 + a % 256) << (k - 8)


def node_shift(a: int) -> int:
    """Width of interval a is 2**node_shift(a)."""
    return 0 if a < 512 else 7 + a // 256 - 8


def build_node_values() -> np.ndarray:
    """Compute the float32 node values |z|(q) with mpmath (slow: a few seconds)."""
    import mpmath

    values = np.empty(NUM_NODES, dtype=np.float32)
    with mpmath.workdps(40):
        scale = mpmath.mpf(2) ** 32
        root2 = mpmath.sqrt(2)
        for a in range(NUM_NODES):
            x = (mpmath.mpf(node_q(a)) + mpmath.mpf("0.5")) / scale
            # Phi^-1(1 - x) = sqrt(2) * erfinv(1 - 2x)
            values[a] = np.float32(float(root2 * mpmath.erfinv(1 - 2 * x)))
    return values


def slopes_from_nodes(values: np.ndarray) -> np.ndarray:
    """Per-interval slope in units of q, pre-scaled by 2**-shift (exact in float64)."""
    v64 = values.astype(np.float64)
    diff = v64[1:] - v64[:-1]
    shifts = np.array([node_shift(a) for a in range(NUM_NODES - 1)], dtype=np.float64)
    return (diff * np.exp2(-shifts)).astype(np.float32)


@lru_cache(maxsize=1)
def normal_table() -> tuple[np.ndarray, np.ndarray]:
    """(node values T, slopes S) as float32 arrays of 6144 entries each."""
    raw = TABLE_FILE.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != TABLE_SHA256:
        raise RuntimeError(
            f"{TABLE_FILE} has SHA-256 {digest}, expected {TABLE_SHA256}; "
            "reinstall zocheck-ray (the Gaussian table must be bit-identical everywhere)"
        )
    values = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if values.shape != (NUM_NODES,):
        raise RuntimeError(f"{TABLE_FILE} holds {values.size} values, expected {NUM_NODES}")
    nodes = np.ascontiguousarray(values[:-1])
    nodes.setflags(write=False)
    slopes = slopes_from_nodes(values)
    slopes.setflags(write=False)
    return nodes, slopes


def write_table(path: Path = TABLE_FILE) -> str:
    """Rebuild `normal_table.bin`; returns its SHA-256."""
    raw = build_node_values().astype("<f4").tobytes()
    path.write_bytes(raw)
    return hashlib.sha256(raw).hexdigest()
