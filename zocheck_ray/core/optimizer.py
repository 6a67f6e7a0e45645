"""`ZOOptimizer`: the trainer side of a ZO step, on any device.

    opt = ZOOptimizer(model.named_parameters(), ZOConfig(lr=1e-6, eps=1e-3))
    record = opt.step(lambda: model(**batch).loss, seed=step_seed)

`step` runs perturb(+eps), loss+, perturb(-2 eps), loss-, perturb(+eps), update,
in place, exactly as `update.py` spells the operations, and returns the
`StepRecord` a replay needs to reproduce it.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from zocheck_ray.core.config import ZOConfig
from zocheck_ray.core.errors import NonFiniteError, StateMismatchError
from zocheck_ray.core.fused import perturbation_cpu
from zocheck_ray.core.generator import check_seed, perturbation
from zocheck_ray.core.layout import EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, Layout, TensorSpec
from zocheck_ray.core.record import StepRecord
from zocheck_ray.core.scalars import StepScalars
from zocheck_ray.core import update

CHUNK_ELEMENTS = 1 << 22
"""Elements processed at once; bounds the generator's temporaries to ~100 MB."""


def chunks(numel: int, size: int = CHUNK_ELEMENTS):
    for start in range(0, numel, size):
        yield start, min(start + size, numel)


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


class ZOOptimizer:
    """Zeroth-order optimizer over named parameters, producing replayable step records."""

    def __init__(self, named_params: Iterable[tuple[str, torch.Tensor]], config: ZOConfig, step: int = 0):
        if not isinstance(config, ZOConfig):
            raise TypeError(f"config must be a ZOConfig, got {type(config).__name__}")
        named = [(n, p) for n, p in named_params]
        self.config = config
        self.layout = Layout.from_params(named, config.optimizer)
        self.params = [p for _, p in named]
        devices = {p.device for p in self.params}
        if len(devices) != 1:
            raise StateMismatchError(f"all parameters must be on one device, found {sorted(map(str, devices))}")
        self.device = self.params[0].device
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

    def _z(self, spec: TensorSpec, seed: int, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":  # the fused generator: same bits, far fewer passes
            z = perturbation_cpu(seed, spec.offset + a, b - a, self.config.perturbation)
        else:
            z = perturbation(seed, spec.offset + a, b - a, self.config.perturbation, self.device)
        return update.cast_perturbation(z, dtype)

    def _perturb(self, seed: int, c: float, masks) -> None:
        for i, spec, flat, a, b in self._walk():
            chunk = flat[a:b]
            zd = self._z(spec, seed, a, b, chunk.dtype)
            mask = masks[(i, a)] if masks is not None else None
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
            masks = {(i, a): update.sparse_mask(flat[a:b].float(), extras[i]) for i, _, flat, a, b in self._walk()}
        # Scalars as the record will carry them; g is filled in after the two losses.
        probe = StepRecord(self.step_index, seed, 0.0, lr, eps, self.fingerprint, self.config.optimizer, extras)
        s = StepScalars.of(probe, self.config)
        self._perturb(seed, s.plus, masks)
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
        state = self.state_tensors()
        for i, spec, flat, a, b in self._walk():
            chunk = flat[a:b]
            zd = self._z(spec, record.seed, a, b, chunk.dtype)
            mask = masks[(i, a)] if masks is not None else None
            chunk.copy_(update.update_chunk(state, spec.name, a, b, chunk.float(), zd, s, spec.decay, chunk.dtype,
                                            self.config.optimizer, mask))
