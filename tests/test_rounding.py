"""The fused kernel's bf16/fp16 conversions equal torch's, bit for bit."""

import numpy as np
import torch
from numba import njit

from zocheck_ray.core import fused


@njit
def _to_bf16(x, out):
    for i in range(x.shape[0]):
        out[i] = np.uint16(fused._bf16_bits(x[i]))


@njit
def _to_f16(x, out):
    for i in range(x.shape[0]):
        out[i] = np.uint16(fused._f16_bits(x[i]))


@njit
def _from_f16(h, out):
    for i in range(h.shape[0]):
        out[i] = fused._f16_value(h[i])


@njit
def _from_bf16(h, out):
    for i in range(h.shape[0]):
        out[i] = fused._bf16_value(h[i])


def interesting_floats() -> np.ndarray:
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 2**32, 3_000_000, dtype=np.uint64).astype(np.uint32)]
    # every fp16 value and the float32 values around each midpoint between neighbours
    halves = np.arange(0, 2**16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    halves = halves[np.isfinite(halves)]
    bits = halves.view(np.uint32)
    for delta in (-1, 0, 1):
        parts.append((bits + np.uint32(4096) + np.uint32(delta % 2**32)).astype(np.uint32))  # near fp16 midpoints
        parts.append((bits + np.uint32(0x8000) + np.uint32(delta % 2**32)).astype(np.uint32))  # near bf16 midpoints
    parts.append(bits)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 65520.0, 65519.996, 6e-8, 2.98e-8, 1e-45,
                         3.4e38], dtype=np.float32).view(np.uint32)
    parts.append(specials)
    out = np.concatenate(parts).view(np.float32)
    return out[~np.isnan(out)]


def test_float32_to_bf16_matches_torch():
    x = interesting_floats()
    out = np.empty(x.size, np.uint16)
    _to_bf16(x, out)
    expected = torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(out, expected)


def test_float32_to_fp16_matches_torch():
    x = interesting_floats()
    out = np.empty(x.size, np.uint16)
    _to_f16(x, out)
    expected = torch.from_numpy(x).half().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(out, expected)


def test_every_fp16_and_bf16_value_widens_exactly():
    h = np.arange(0, 2**16, dtype=np.uint32).astype(np.uint16)
    for widen, dtype in ((_from_f16, torch.float16), (_from_bf16, torch.bfloat16)):
        out = np.empty(h.size, np.float32)
        widen(h, out)
        expected = torch.from_numpy(h.view(np.int16)).view(dtype).float().numpy()
        finite = ~np.isnan(expected)
        assert np.array_equal(out[finite].view(np.uint32), expected[finite].view(np.uint32))
        assert np.isnan(out[~finite]).all()
