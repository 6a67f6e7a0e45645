"""The ZO operation sequences in eager torch, one IEEE operation at a time.

Each function rounds to the parameter dtype after every operation, as torch does eagerly for
bf16/fp16, and uses no fused form (`add_(alpha=)`, `addcmul`, `lerp`), so nothing can contract a
multiply and an add into an FMA. A step of q perturbations, seeds s_j, projected gradients g_j:

    perturb:     for j = 0 .. q-1, for c = +eps, -2 eps, +eps:  t = r(zd_j * c);  p = r(p + t)
    estimate:    a = zd_0 * G_0;  a = a + zd_j * G_j for j = 1 .. q-1        (float32, G_j = f32(g_j / q))
    zo-sgd:      u = r(a);  [u = r(u + r(p * wd))];  p = r(p - r(u * lr))
    zo-adam:     m = m*b1 + a*(1-b1);  v = v*b2 + (a*a)*(1-b2)
                 u = (m*bc1) / (sqrt(v*bc2) + eps_a)     (sqrt correctly rounded);  [u = u + p*wd]   (float32)
                 p = r(p - r(u * lr))
    sparse-mezo: zo-sgd on elements with |p_start| <= threshold, others untouched
    zo-sgd-sign: zo-sgd with G_j = f32(sgn(g_j) / q)  (ZO-Bench's sign(g) z)
    zo-signsgd:  u = sgn(a) = (a > 0) - (a < 0)  (exact: -1, 0 or 1);  [u = r(u + r(p * wd))];  p = r(p - r(u * lr))
    zo-sgd-mmt:  m = m*mu + a;  u = m;  [u = u + p*wd]   (float32);  p = r(p - r(u * lr))
    zo-sgd-cons: for each move c of the record's decision (a multiple of lr, or none):
                 u = r(a);  [u = r(u + r(p * wd))];  p = r(p - r(u * c))

zd_j = r(z_j); bracketed decay terms apply to decayed tensors when wd > 0.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from zocheck_ray.core.layout import EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, MOMENTUM_PREFIX, moment_prefixes
from zocheck_ray.core.scalars import StepScalars


CHUNK_ELEMENTS = 1 << 22
"""Elements the eager paths process at once (bounds the generator's temporaries)."""


def chunks(numel: int, size: int = CHUNK_ELEMENTS):
    """(start, end) of each `size`-element piece of `numel` elements."""
    for start in range(0, numel, size):
        yield start, min(start + size, numel)


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if dtype == torch.float32 else x.to(dtype).to(torch.float32)


def cast_perturbation(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _round(z, dtype)


def perturb(p: torch.Tensor, zd: torch.Tensor, c: float, dtype: torch.dtype, mask=None) -> torch.Tensor:
    out = _round(p + _round(zd * c, dtype), dtype)
    return out if mask is None else torch.where(mask, out, p)


def estimate(zds: list[torch.Tensor], s: StepScalars) -> torch.Tensor:
    """a = zd_0 * G_0 (+ zd_j * G_j, in order), float32: the step's gradient estimate."""
    a = zds[0] * s.grads[0]
    for zd, g in zip(zds[1:], s.grads[1:]):
        a = a + zd * g
    return a


def sign(a: torch.Tensor) -> torch.Tensor:
    """(a > 0) - (a < 0): -1, 0 or 1 (0 for NaN), exactly."""
    return (a > 0).to(torch.float32) - (a < 0).to(torch.float32)


def sgd_move(p, a, c: float, s: StepScalars, decay: bool, dtype, sign_of: bool = False) -> torch.Tensor:
    """u = r(a) (or sgn(a));  [u = r(u + r(p * wd))];  p = r(p - r(u * c))."""
    u = sign(a) if sign_of else _round(a, dtype)
    if decay and s.weight_decay > 0:
        u = _round(u + _round(p * s.weight_decay, dtype), dtype)
    return _round(p - _round(u * c, dtype), dtype)


def sgd_update(p, zd, s: StepScalars, decay: bool, dtype, mask=None) -> torch.Tensor:
    """ZO-SGD's update of one perturbation (the trainer's fast path)."""
    out = sgd_move(p, zd * s.grad, s.lr, s, decay, dtype)
    return out if mask is None else torch.where(mask, out, p)


def correctly_rounded_sqrt(x: torch.Tensor) -> torch.Tensor:
    """IEEE float32 sqrt: torch's float32 CPU sqrt can be off by an ulp; the float64 sqrt rounded once is
    correctly rounded."""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def adam_update(p, m, v, a, s: StepScalars, decay: bool, dtype):
    """The new (p, m, v), m and v float32, from the estimate `a`."""
    m = m * s.beta1 + a * s.one_minus_beta1
    v = v * s.beta2 + (a * a) * s.one_minus_beta2
    u = (m * s.bias_correction1) / (correctly_rounded_sqrt(v * s.bias_correction2) + s.adam_eps)
    if decay and s.weight_decay > 0:
        u = u + p * s.weight_decay
    return _round(p - _round(u * s.lr, dtype), dtype), m, v


def momentum_update(p, m, a, s: StepScalars, decay: bool, dtype):
    """Returns the new (p, m); m is float32."""
    m = m * s.momentum + a
    u = m
    if decay and s.weight_decay > 0:
        u = u + p * s.weight_decay
    return _round(p - _round(u * s.lr, dtype), dtype), m


def sparse_thresholds(params: list[torch.Tensor], sparsity: float) -> tuple[float, ...]:
    """Per tensor, the magnitude at or below which Sparse-MeZO perturbs an element."""
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
    """A bool mask packed 8 elements a byte (bit j of byte k is element 8k + j)."""
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


def perturb_all(p: torch.Tensor, zds: list[torch.Tensor], s: StepScalars, dtype, mask=None) -> torch.Tensor:
    """The step's 3q perturbations: +eps, -2 eps, +eps with each zd_j in turn."""
    for zd in zds:
        for c in (s.plus, s.minus, s.plus):
            p = perturb(p, zd, c, dtype, mask)
    return p


def update_chunk(state: dict[str, torch.Tensor], name: str, a: int, b: int, p: torch.Tensor, zds: list[torch.Tensor],
                 s: StepScalars, decay: bool, dtype: torch.dtype, optimizer: str, mask=None) -> torch.Tensor:
    """The new p of elements a..b of `name` from their perturbed float32 values `p`, `state`'s buffers updated in
    place."""
    est = estimate(zds, s)
    if optimizer == "zo-adam":
        m = state[EXP_AVG_PREFIX + name].view(-1)[a:b]
        v = state[EXP_AVG_SQ_PREFIX + name].view(-1)[a:b]
        p, m_new, v_new = adam_update(p, m, v, est, s, decay, dtype)
        m.copy_(m_new)
        v.copy_(v_new)
        return p
    if optimizer == "zo-sgd-mmt":
        m = state[MOMENTUM_PREFIX + name].view(-1)[a:b]
        p, m_new = momentum_update(p, m, est, s, decay, dtype)
        m.copy_(m_new)
        return p
    out = p
    for c in s.moves:  # one move, or ZO-SGD-Cons' two or three
        out = sgd_move(out, est, c, s, decay, dtype, sign_of=optimizer == "zo-signsgd")
    return out if mask is None else torch.where(mask, out, p)


def step_tensor(p: torch.Tensor, buffers: list[torch.Tensor], zds: list[torch.Tensor], s: StepScalars, decay: bool,
                optimizer: str, threshold: float | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One whole step on one stored tensor and its float32 `buffers`: (new p, new buffers), the oracle the kernels
    are compared with."""
    dtype = p.dtype
    x = p.reshape(-1).float()
    mask = sparse_mask(x, threshold) if optimizer == "sparse-mezo" else None
    x = perturb_all(x, zds, s, dtype, mask)
    state = {prefix + "t": b.reshape(-1).clone() for prefix, b in zip(moment_prefixes(optimizer), buffers)}
    x = update_chunk(state, "t", 0, x.numel(), x, zds, s, decay, dtype, optimizer, mask)
    return x.to(dtype).view(p.shape), [t.view(b.shape) for t, b in zip(state.values(), buffers)]
