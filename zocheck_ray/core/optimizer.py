"""`ZOOptimizer`: the trainer side of a ZO step, on any device.

    opt = ZOOptimizer(model.named_parameters(), ZOConfig(lr=1e-6, eps=1e-3))
    record = opt.step(lambda: model(**batch).loss, seed=step_seed)

`step` perturbs and evaluates for each perturbation, updates in place exactly as `update.py` spells
it, and returns the `StepRecord` a replay needs; every backend gives the same bits (`backend.py`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable

import torch

from zocheck_ray.core import update
from zocheck_ray.core.backend import BACKENDS, kernel_stepper
from zocheck_ray.core.config import ZOConfig
from zocheck_ray.core.errors import NonFiniteError, StateMismatchError
from zocheck_ray.core.fused import perturbation_into
from zocheck_ray.core.generator import perturbation
from zocheck_ray.core.layout import Layout, TensorSpec, moment_prefixes
from zocheck_ray.core.record import CONS_ASCENT, CONS_DESCENT, CONS_START, StepRecord
from zocheck_ray.core.scalars import StepScalars
from zocheck_ray.core.seeds import check_seed, perturbation_seeds
from zocheck_ray.core.update import CHUNK_ELEMENTS, chunks, sparse_thresholds

class ZOOptimizer:
    """Zeroth-order optimizer over named parameters, producing replayable step records."""

    def __init__(self, named_params: Iterable[tuple[str, torch.Tensor]], config: ZOConfig, step: int = 0,
                 backend: str = "auto"):
        if not isinstance(config, ZOConfig):
            raise TypeError(f"config must be a ZOConfig, got {type(config).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        named = [(n, p) for n, p in named_params]
        self.config = config
        self.layout = Layout.from_params(named, config.optimizer)
        self.params = [p for _, p in named]
        first_name, first = named[0]
        for name, p in named:
            if p.device != first.device:
                raise StateMismatchError(
                    f"parameter {name!r} is on {p.device} but {first_name!r} is on {first.device}; a ZO step "
                    "perturbs every parameter with one generator, so the model must be on one device "
                    "(move it with model.to(device) before building the optimizer)"
                )
        self.device = first.device
        for spec, p in zip(self.layout.params, self.params):
            if not p.is_contiguous():
                raise StateMismatchError(f"parameter {spec.name!r} is not contiguous")
        self.fingerprint = self.layout.fingerprint(config)
        self.buffers: list[list[torch.Tensor]] = [
            [torch.zeros(p.shape, dtype=torch.float32, device=self.device) for p in self.params]
            for _ in moment_prefixes(config.optimizer)]
        """The optimizer's float32 buffers per kind (`moment_prefixes` order), one per parameter."""
        self.exp_avg: list[torch.Tensor] = self.buffers[0] if self.buffers else []
        """ZO-Adam's first moments, ZO-SGD-MMT's momentum (the kernels' first buffer)."""
        self.exp_avg_sq: list[torch.Tensor] = self.buffers[1] if len(self.buffers) > 1 else []
        self.step_index = step
        self.last_losses: tuple[float, float] | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        stepper, check = kernel_stepper(self.layout, self.params, self.exp_avg, self.exp_avg_sq, config, backend)
        self.kernel_check = check
        """The start-up guard's `KernelCheck` where the kernels were considered, else None."""
        self._stepper = stepper

    @property
    def kernel_backend(self) -> str:
        """"triton" when the steps run the fused GPU kernels, "eager" otherwise."""
        return "eager" if self._stepper is None else "triton"

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The canonical state (live tensors, not copies): parameters, then moments."""
        state = {s.name: p.data for s, p in zip(self.layout.params, self.params)}
        for prefix, block in zip(moment_prefixes(self.config.optimizer), self.buffers):
            for s, m in zip(self.layout.params, block):
                state[prefix + s.name] = m
        return state

    @torch.no_grad()
    def load_state_tensors(self, state: dict[str, torch.Tensor], step: int) -> None:
        """Copy a canonical state in (e.g. a recovered image) and continue at `step`."""
        if Layout.from_state(state, self.config) != self.layout:
            raise StateMismatchError("the state's names, order, shapes or dtypes differ from the optimizer's")
        for name, target in self.state_tensors().items():
            target.copy_(state[name])
        self.step_index = step

    def _walk(self):
        for i, (spec, p) in enumerate(zip(self.layout.params, self.params)):
            flat = p.data.view(-1)
            for a, b in chunks(spec.numel):
                yield i, spec, flat, a, b

    def _scratch(self, name: str, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A CPU buffer reused across chunks and steps (fresh large allocations page-fault)."""
        buf = self._buffers.get((name, dtype))
        if buf is None or buf.numel() < numel:
            size = min(CHUNK_ELEMENTS, max(s.numel for s in self.layout.params))
            buf = self._buffers[(name, dtype)] = torch.empty(size, dtype=dtype)
        return buf[:numel]

    def _z(self, spec: TensorSpec, seed: int, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """zd = r(z) (float32) for elements a..b of `spec`."""
        if self.device.type != "cpu":
            z = perturbation(seed, spec.offset + a, b - a, self.config.perturbation, self.device)
            return update.cast_perturbation(z, dtype)
        # the fused generator (same bits, far fewer passes) into a reused buffer, rounded there
        z = self._scratch("z", b - a)
        if b > a:
            perturbation_into(z.numpy(), seed, spec.offset + a, self.config.perturbation)
        if dtype != torch.float32:
            z.copy_(self._scratch("z", b - a, dtype).copy_(z))
        return z

    def _rounded(self, name: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x rounded to `dtype` (to nearest even), held in a `dtype` scratch buffer."""
        return x if dtype == torch.float32 else self._scratch(name, x.numel(), dtype).copy_(x)

    def _perturb_in_place(self, chunk: torch.Tensor, zd: torch.Tensor, c: float) -> None:
        """update.perturb's operations on a CPU chunk without allocating: `chunk.add_(t)` in the dtype rounds once."""
        t = torch.mul(zd, c, out=self._scratch("t", chunk.numel()))
        chunk.add_(self._rounded("t", t, chunk.dtype))

    def _sgd_in_place(self, chunk: torch.Tensor, zd: torch.Tensor, s: StepScalars, decay: bool) -> None:
        """update.sgd_update's operations, in place."""
        n, dtype = chunk.numel(), chunk.dtype
        u32 = torch.mul(zd, s.grad, out=self._scratch("t", n))
        u = self._rounded("u", u32, dtype)
        if decay and s.weight_decay > 0:
            x = chunk if dtype == torch.float32 else self._scratch("x", n).copy_(chunk)
            u.add_(self._rounded("decay", torch.mul(x, s.weight_decay, out=self._scratch("decay", n)), dtype))
        if dtype != torch.float32:
            u32.copy_(u)
        chunk.sub_(self._rounded("step", u32.mul_(s.lr), dtype))

    def _perturb(self, seed: int, c: float, masks, first: bool = False, thresholds=()) -> None:
        if self._stepper is not None:
            self._stepper.perturb(seed, c, first, thresholds)
            return
        for i, spec, flat, a, b in self._walk():
            chunk = flat[a:b]
            zd = self._z(spec, seed, a, b, chunk.dtype)
            if masks is None and self.device.type == "cpu":
                self._perturb_in_place(chunk, zd, c)
                continue
            mask = update.unpack_mask(masks[(i, a)], b - a) if masks is not None else None
            chunk.copy_(update.perturb(chunk.float(), zd, c, chunk.dtype, mask))

    @torch.no_grad()
    def step(self, closure: Callable[[], object], seed: int, lr: float | None = None,
             combine: Callable[[object, object], tuple[float, float]] | None = None) -> StepRecord:
        """One ZO step; `closure` returns the loss. `combine(out_a, out_b) -> (loss_a, loss_b)` lets data-parallel
        ranks form the same g from every rank's loss sums."""
        check_seed(seed)
        lr = self.config.lr if lr is None else float(lr)
        eps = self.config.eps
        if not math.isfinite(lr) or lr < 0:
            raise NonFiniteError(f"lr must be finite and >= 0, got {lr!r}")
        optimizer = self.config.optimizer
        extras: tuple[float, ...] = ()
        masks = None
        if optimizer == "sparse-mezo":
            extras = sparse_thresholds(self.params, self.config.sparsity)
            if self._stepper is None:  # packed, one bit per element (the kernels keep their own)
                masks = {(i, a): update.pack_mask(update.sparse_mask(flat[a:b].float(), extras[i]))
                         for i, _, flat, a, b in self._walk()}
        seeds = perturbation_seeds(seed, self.config.num_perturbations)
        # Scalars as the record will carry them; the gradients are filled in after the losses.
        probe = StepRecord(self.step_index, seed, 0.0, lr, eps, self.fingerprint, optimizer, extras,
                           (0.0,) * (len(seeds) - 1))
        s = StepScalars.of(probe, self.config)
        losses = self._losses(combine)
        start = closure() if optimizer == "zo-sgd-cons" else None  # the start's loss, before any perturbation
        grads, first_pair = [], None
        for j, seed_j in enumerate(seeds):
            self._perturb(seed_j, s.plus, masks, first=j == 0, thresholds=extras)
            out_plus = closure()
            self._perturb(seed_j, s.minus, masks)
            out_minus = closure()
            self._perturb(seed_j, s.plus, masks)
            loss_plus, loss_minus = losses(out_plus, out_minus, "loss+", "loss-")
            grads.append(_clipped((loss_plus - loss_minus) / (2.0 * eps), self.config.grad_clip))
            first_pair = first_pair or (loss_plus, loss_minus)
        record = StepRecord(self.step_index, seed, grads[0], lr, eps, self.fingerprint, optimizer, extras,
                            tuple(grads[1:]))
        if optimizer == "zo-sgd-cons":
            record = self._conservative(record, masks, closure, losses, start)
        else:
            self._update(record, masks)
        self.step_index += 1
        self.last_losses = first_pair
        return record

    def _losses(self, combine):
        """(out_a, out_b, names) -> two finite float losses, through `combine` where there is one."""
        def losses(out_a, out_b, name_a: str, name_b: str) -> tuple[float, float]:
            a, b = (float(out_a), float(out_b)) if combine is None else combine(out_a, out_b)
            if not (math.isfinite(a) and math.isfinite(b)):
                raise NonFiniteError(
                    f"step {self.step_index}: non-finite loss ({name_a}={a}, {name_b}={b}); "
                    "lower eps or lr, or use a wider dtype"
                )
            return a, b
        return losses

    def _conservative(self, record: StepRecord, masks, closure, losses, start_out) -> StepRecord:
        """ZO-Bench's ZO-SGD-Cons: evaluate at the descent step and the ascent step and keep the candidate of
        lowest loss; the record's decision tells replay which moves were made."""
        s = StepScalars.of(record, self.config)
        lr = s.moves[0]
        self._update(record, masks, s.with_moves(lr))
        out_descent = closure()
        self._update(record, masks, s.with_moves(s.moves[1]))
        out_ascent = closure()
        start, _ = losses(start_out, start_out, "loss at the start", "loss at the start")
        descent, ascent = losses(out_descent, out_ascent, "loss after the descent step", "loss after the ascent step")
        # ZO-Bench's rule, ties included
        if descent > start:
            decision = CONS_START if start < ascent else CONS_ASCENT
        else:
            decision = CONS_DESCENT if descent < ascent else CONS_ASCENT
        record = dataclasses.replace(record, decision=decision)
        final = StepScalars.of(record, self.config).moves[2:]
        if final:
            self._update(record, masks, s.with_moves(*final))
        return record

    def _estimate(self, spec: TensorSpec, seeds, a: int, b: int, dtype: torch.dtype, s: StepScalars) -> torch.Tensor:
        """The estimate a of elements a..b (float32, in a buffer of its own)."""
        acc = self._scratch("estimate", b - a)
        for j, seed_j in enumerate(seeds):
            zd = self._z(spec, seed_j, a, b, dtype)
            if j == 0:
                torch.mul(zd, s.grads[0], out=acc)
            else:
                acc.add_(torch.mul(zd, s.grads[j], out=self._scratch("t", b - a)))
        return acc if self.device.type == "cpu" else acc.clone()

    def _update(self, record: StepRecord, masks, s: StepScalars | None = None) -> None:
        """The update after the perturbations, in place; `s` carries the moves to make now."""
        s = StepScalars.of(record, self.config) if s is None else s
        optimizer = self.config.optimizer
        seeds = perturbation_seeds(record.seed, len(record.grads))
        if self._stepper is not None:
            self._stepper.update(record.seed, s)
            return
        state = self.state_tensors()
        for i, spec, flat, a, b in self._walk():
            chunk = flat[a:b]
            fast = optimizer in ("zo-sgd", "zo-sgd-sign") and len(seeds) == 1
            if masks is None and self.device.type == "cpu" and fast:
                self._sgd_in_place(chunk, self._z(spec, record.seed, a, b, chunk.dtype), s, spec.decay)
                continue
            mask = update.unpack_mask(masks[(i, a)], b - a) if masks is not None else None
            if self.device.type == "cpu":
                est = self._estimate(spec, seeds, a, b, chunk.dtype, s)
                chunk.copy_(update.update_chunk(state, spec.name, a, b, chunk.float(), [est], _unit(s), spec.decay,
                                                chunk.dtype, optimizer, mask))
            else:
                zds = [self._z(spec, seed_j, a, b, chunk.dtype) for seed_j in seeds]
                chunk.copy_(update.update_chunk(state, spec.name, a, b, chunk.float(), zds, s, spec.decay,
                                                chunk.dtype, optimizer, mask))


def _clipped(g: float, bound: float | None) -> float:
    return g if bound is None else min(max(g, -bound), bound)


def _unit(s: StepScalars) -> StepScalars:
    """`s` with a unit gradient, for `update_chunk` of an estimate formed already."""
    return dataclasses.replace(s, grads=(1.0,))
