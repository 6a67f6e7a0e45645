"""The ZO operation sequences in eager torch, one IEEE operation at a time.

Each function works on a float32 working copy of a flat chunk and rounds to the
parameter dtype after every operation (`_round`), as torch does eagerly for
bf16/fp16; for float32 the rounding is the identity. No fused forms
(`add_(alpha=)`, `addcmul`, `lerp`) are used: each statement is one kernel, so no
compiler can contract a multiply and an add into an FMA.

    perturb(c):  t = r(zd * c);  p = r(p + t)             c = +eps, -2 eps, +eps
    zo-sgd:      u = r(zd * g);  [u = r(u + r(p * wd))];  p = r(p - r(u * lr))
    zo-adam:     gz = zd * g;  m = m*b1 + gz*(1-b1);  v = v*b2 + (gz*gz)*(1-b2)
                 u = (m*bc1) / (sqrt(v*bc2) + eps_a)     (sqrt correctly rounded);  [u = u + p*wd]   (float32)
                 p = r(p - r(u * lr))
    sparse-mezo: zo-sgd on elements with |p_start| <= threshold, others untouched

where zd = r(z) is the perturbation rounded to the parameter dtype and the
bracketed decay terms apply only to decayed tensors when wd > 0.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from zocheck_ray.core.layout import EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX
from zocheck_ray.core.scalars import StepScalars


CHUNK_ELEMENTS = 1 << 22
"""Elements the eager paths (the reference replay, the trainer's eager steps) process at once;
bounds the generator's temporaries to ~100 MB."""


def chunks(numel: int, size: int = CHUNK_ELEMENTS):
    """(start, end) of each `size`-element piece of a tensor of `numel` elements, in order."""
    for start in range(0, numel, size):
        yield start, min(start + size, numel)


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if dtype == torch.float32 else x.to(dtype).to(torch.float32)


def cast_perturbation(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _round(z, dtype)


def perturb(p: torch.Tensor, zd: torch.Tensor, c: float, dtype: torch.dtype, mask=None) -> torch.Tensor:
    out = _round(p + _round(zd * c, dtype), dtype)
    return out if mask is None else torch.where(mask, out, p)


def sgd_update(p, zd, s: StepScalars, decay: bool, dtype, mask=None) -> torch.Tensor:
    u = _round(zd * s.grad, dtype)
    if decay and s.weight_decay > 0:
        u = _round(u + _round(p * s.weight_decay, dtype), dtype)
    out = _round(p - _round(u * s.lr, dtype), dtype)
    return out if mask is None else torch.where(mask, out, p)


def correctly_rounded_sqrt(x: torch.Tensor) -> torch.Tensor:
    """IEEE float32 sqrt. torch's float32 CPU sqrt is off by an ulp for ~17% of inputs
    on AVX-512 machines; the float64 sqrt rounded once to float32 is the correctly
    rounded result (double rounding is innocuous for sqrt at 53 >= 2*24 + 2 bits)."""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def adam_update(p, m, v, zd, s: StepScalars, decay: bool, dtype):
    """Returns the new (p, m, v); m and v are float32."""
    gz = zd * s.grad
    m = m * s.beta1 + gz * s.one_minus_beta1
    v = v * s.beta2 + (gz * gz) * s.one_minus_beta2
    u = (m * s.bias_correction1) / (correctly_rounded_sqrt(v * s.bias_correction2) + s.adam_eps)
    if decay and s.weight_decay > 0:
        u = u + p * s.weight_decay
    return _round(p - _round(u * s.lr, dtype), dtype), m, v


def sparse_thresholds(params: list[torch.Tensor], sparsity: float) -> tuple[float, ...]:
    """Per tensor, the magnitude at or below which Sparse-MeZO perturbs an element
    (the trainer computes them at a step's start; its record carries them)."""
    out = []
    for p in params:
        flat = p.detach().reshape(-1).float().abs()
        if flat.numel() == 0:
            out.append(0.0)
            continue
        k = max(1, math.ceil((1.0 - sparsity) * flat.numel()))
        out.append(float(torch.kthvalue(flat, k).values))
    return tuple(out)


def sparse_mask(p_start: torch.Tensor, threshold: float) -> torch.Tensor:
    """Elements Sparse-MeZO perturbs: |p| <= threshold, on the step's starting values."""
    return p_start.abs() <= threshold


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask packed 8 elements a byte (bit j of byte k is element 8k + j): one bit per element."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    return pack_mask_torch(mask)


def unpack_mask(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The bool mask of `numel` elements that `pack_mask` packed."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=numel, bitorder="little").view(np.bool_))
    return unpack_mask_torch(packed, numel)


def pack_mask_torch(mask: torch.Tensor) -> torch.Tensor:
    """`pack_mask` in torch operations (any device)."""
    padded = torch.nn.functional.pad(mask.to(torch.uint8), (0, (-mask.numel()) % 8))
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def unpack_mask_torch(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """`unpack_mask` in torch operations (any device)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & 1).view(-1)[:numel].bool()


def update_chunk(state: dict[str, torch.Tensor], name: str, a: int, b: int, p: torch.Tensor, zd: torch.Tensor,
                 s: StepScalars, decay: bool, dtype: torch.dtype, optimizer: str, mask=None) -> torch.Tensor:
    """The update of elements a..b of parameter `name` (p: their float32 values after the
    perturbations); ZO-Adam moments are updated in `state` in place. Returns the new p."""
    if optimizer != "zo-adam":
        return sgd_update(p, zd, s, decay, dtype, mask)
    m = state[EXP_AVG_PREFIX + name].view(-1)[a:b]
    v = state[EXP_AVG_SQ_PREFIX + name].view(-1)[a:b]
    p, m_new, v_new = adam_update(p, m, v, zd, s, decay, dtype)
    m.copy_(m_new)
    v.copy_(v_new)
    return p
