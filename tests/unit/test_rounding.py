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


@njit
def _round_all(x, out):
    for i in range(x.shape[0]):
        out[0, i] = fused._round_bf16(x[i])
        out[1, i] = fused._round_bf16_inner(x[i])
        out[2, i] = fused._round_f16(x[i])
        out[3, i] = fused._round_f16_inner(x[i])


def test_update_roundings_equal_torch_round_trips():
    """The update's float32 -> dtype -> float32 roundings, full and inner, are torch's."""
    x = interesting_floats()
    out = np.empty((4, x.size), np.float32)
    _round_all(x, out)
    t = torch.from_numpy(x)
    for row, dtype in ((0, torch.bfloat16), (1, torch.bfloat16), (2, torch.float16), (3, torch.float16)):
        expected = t.to(dtype).float().numpy()
        assert np.array_equal(out[row].view(np.uint32), expected.view(np.uint32)), (row, dtype)


def test_inner_roundings_keep_nans_from_rounded_operands():
    # NaNs the update can meet have the dtype's dropped mantissa bits zero; they stay NaN
    rng = np.random.default_rng(1)
    payload = rng.integers(1, 2**22, 100_000, dtype=np.uint64).astype(np.uint32)
    sign = rng.integers(0, 2, payload.size, dtype=np.uint64).astype(np.uint32) << np.uint32(31)
    for row, dropped in ((1, 0xFFFF), (3, 0x1FFF)):
        nans = (np.uint32(0x7F800000) | sign | (payload & np.uint32(0x7FFFFF & ~dropped))).astype(np.uint32)
        nans = nans[(nans & np.uint32(0x7FFFFF)) != 0].view(np.float32)
        out = np.empty((4, nans.size), np.float32)
        _round_all(nans, out)
        assert np.isnan(out[row]).all()
        full = out[row - 1].view(np.uint32) & np.uint32(0x7FFFFFFF if row == 3 else 0xFFFFFFFF)
        assert (full == np.uint32(0x7FC00000)).all()  # the full roundings: quiet NaN (fp16 keeps the sign)
