"""`ZOOptimizer`: the trainer side of a ZO step, on any device.

    opt = ZOOptimizer(model.named_parameters(), ZOConfig(lr=1e-6, eps=1e-3))
    record = opt.step(lambda: model(**batch).loss, seed=step_seed)

`step` runs perturb(+eps), loss+, perturb(-2 eps), loss-, perturb(+eps), update,
in place, exactly as `update.py` spells the operations, and returns the
`StepRecord` a replay needs to reproduce it.

Two backends, one answer: "eager" works through each tensor in chunks (z from the
fused numba generator on the CPU, from the eager oracle elsewhere, then one torch
operation at a time); "triton" runs each phase as one fused kernel launch per dtype
(`triton_kernels.py`). `backend="auto"` takes the kernels on CUDA once they pass the
start-up guard (`kernel_guard.py`) and the eager path otherwise (`backend.py` decides);
`kernel_backend` and `kernel_check` say which was taken and why. `backend="triton"` on CPU
tensors runs the kernels in Triton's interpreter (the tests drive the CUDA code path that way).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from zocheck_ray.core import update
from zocheck_ray.core.backend import BACKENDS, kernel_stepper
from zocheck_ray.core.config import ZOConfig
from zocheck_ray.core.errors import NonFiniteError, StateMismatchError
from zocheck_ray.core.fused import perturbation_into
from zocheck_ray.core.generator import perturbation
from zocheck_ray.core.layout import EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, Layout, TensorSpec
from zocheck_ray.core.record import StepRecord
from zocheck_ray.core.scalars import StepScalars
from zocheck_ray.core.seeds import check_seed
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
        self.exp_avg: list[torch.Tensor] = []
        self.exp_avg_sq: list[torch.Tensor] = []
        if config.optimizer == "zo-adam":
            self.exp_avg = [torch.zeros(p.shape, dtype=torch.float32, device=self.device) for p in self.params]
            self.exp_avg_sq = [torch.zeros(p.shape, dtype=torch.float32, device=self.device) for p in self.params]
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
        for s, m in zip(self.layout.params, self.exp_avg):
            state[EXP_AVG_PREFIX + s.name] = m
        for s, v in zip(self.layout.params, self.exp_avg_sq):
            state[EXP_AVG_SQ_PREFIX + s.name] = v
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
        """update.perturb's operations on a CPU chunk with no allocation: t = r(zd * c); p = r(p + t).

        `chunk.add_(t)` with both in the dtype is one float32 addition rounded once to the dtype,
        which is what the eager sequence computes."""
        t = torch.mul(zd, c, out=self._scratch("t", chunk.numel()))
        chunk.add_(self._rounded("t", t, chunk.dtype))

    def _sgd_in_place(self, chunk: torch.Tensor, zd: torch.Tensor, s: StepScalars, decay: bool) -> None:
        """update.sgd_update's operations, in place: u = r(zd * g); [u = r(u + r(p * wd))]; p = r(p - r(u * lr))."""
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
        """One ZO step; `closure` returns the loss at the current parameters.

        `combine(out_plus, out_minus) -> (loss_plus, loss_minus)`: with it, the closure's two
        results are turned into the losses g is formed from, after the last perturbation (a
        data-parallel rank gathers every rank's loss sums here, so all ranks form the same g)."""
        check_seed(seed)
        lr = self.config.lr if lr is None else float(lr)
        eps = self.config.eps
        if not math.isfinite(lr) or lr < 0:
            raise NonFiniteError(f"lr must be finite and >= 0, got {lr!r}")
        extras: tuple[float, ...] = ()
        masks = None
        if self.config.optimizer == "sparse-mezo":
            extras = sparse_thresholds(self.params, self.config.sparsity)
            if self._stepper is None:  # packed, one bit per element (the kernels keep their own)
                masks = {(i, a): update.pack_mask(update.sparse_mask(flat[a:b].float(), extras[i]))
                         for i, _, flat, a, b in self._walk()}
        # Scalars as the record will carry them; g is filled in after the two losses.
        probe = StepRecord(self.step_index, seed, 0.0, lr, eps, self.fingerprint, self.config.optimizer, extras)
        s = StepScalars.of(probe, self.config)
        self._perturb(seed, s.plus, masks, first=True, thresholds=extras)
        out_plus = closure() if combine is not None else float(closure())
        self._perturb(seed, s.minus, masks)
        out_minus = closure() if combine is not None else float(closure())
        self._perturb(seed, s.plus, masks)
        loss_plus, loss_minus = (out_plus, out_minus) if combine is None else combine(out_plus, out_minus)
        if not (math.isfinite(loss_plus) and math.isfinite(loss_minus)):
            raise NonFiniteError(
                f"step {self.step_index}: non-finite loss (loss+={loss_plus}, loss-={loss_minus}); "
                "lower eps or lr, or use a wider dtype"
            )
        grad = (loss_plus - loss_minus) / (2.0 * eps)
        record = StepRecord(self.step_index, seed, grad, lr, eps, self.fingerprint, self.config.optimizer, extras)
        self._update(record, masks)
        self.step_index += 1
        self.last_losses = (loss_plus, loss_minus)
        return record

    def _update(self, record: StepRecord, masks) -> None:
        """The update after the three perturbations, in place; z is regenerated once more."""
        s = StepScalars.of(record, self.config)
        if self._stepper is not None:
            self._stepper.update(record.seed, s)
            return
        state = self.state_tensors()
        for i, spec, flat, a, b in self._walk():
            chunk = flat[a:b]
            zd = self._z(spec, record.seed, a, b, chunk.dtype)
            if masks is None and self.device.type == "cpu" and self.config.optimizer == "zo-sgd":
                self._sgd_in_place(chunk, zd, s, spec.decay)
                continue
            mask = update.unpack_mask(masks[(i, a)], b - a) if masks is not None else None
            chunk.copy_(update.update_chunk(state, spec.name, a, b, chunk.float(), zd, s, spec.decay, chunk.dtype,
                                            self.config.optimizer, mask))
