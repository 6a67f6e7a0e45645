"""The start-up guard: the GPU kernels must give the CPU oracle's bits, or they are not used.

    check = check_kernels(torch.device("cuda"), (torch.bfloat16,), config)
    check.passed, check.backend, check.mismatches

On a sample of awkward tensors the kernels run two steps of the job's optimizer as the trainer and as
a replay would, and each result must be `torch.equal` to the eager oracle's on the CPU; otherwise the
trainer runs eagerly and says why, so exactness is never traded for speed silently.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from zocheck_ray.core import update
from zocheck_ray.core.gpu import triton_kernels
from zocheck_ray.core.config import ZOConfig
from zocheck_ray.core.generator import perturbation
from zocheck_ray.core.dtypes import REPLAYED
from zocheck_ray.core.layout import moment_prefixes
from zocheck_ray.core.record import StepRecord
from zocheck_ray.core.scalars import StepScalars
from zocheck_ray.core.seeds import perturbation_seeds
from zocheck_ray.core.gpu.triton_kernels import KernelStepper, Segment, perturbation_triton
from zocheck_ray.core.update import sparse_thresholds

logger = logging.getLogger(__name__)

SAMPLE = ((0, 1, False), (5, 131, True), (2**32 + 3, 1029, True), (2**34 + 1, 4099, False))
"""(global offset, numel, decay) of the sample tensors."""
SEEDS = (0x0123456789ABCDEF, 2**64 - 1)
"""One per step checked (the second one's key words are all ones)."""


@dataclass(frozen=True)
class KernelCheck:
    """What the start-up guard found; the trainer's metrics and summary report it."""

    backend: str
    """"triton" when the kernels passed and are used, "eager" otherwise."""
    passed: bool | None
    """True: the kernels gave the oracle's bits; False: they did not; None: not checked."""
    device: str
    dtypes: tuple[str, ...] = ()
    mismatches: tuple[str, ...] = ()
    """What differed (or the error), one line each."""
    reason: str = ""
    seconds: float = 0.0
    checks: int = 0
    """Tensors compared."""

    def as_dict(self) -> dict:
        return {"backend": self.backend, "passed": self.passed, "device": self.device, "dtypes": list(self.dtypes),
                "mismatches": list(self.mismatches), "reason": self.reason, "seconds": self.seconds,
                "checks": self.checks}


_cache: dict[tuple, KernelCheck] = {}


def clear_cache() -> None:
    _cache.clear()


@contextlib.contextmanager
def inject_fault_for_tests(hook: Callable[[int, list[torch.Tensor]], None]):
    """Within the block `hook(phase, written_tensors)` runs after each launch and the guard checks afresh."""
    previous = triton_kernels.set_launch_hook(hook)
    clear_cache()
    try:
        yield
    finally:
        triton_kernels.set_launch_hook(previous)
        clear_cache()


def _oracle_step(p: torch.Tensor, buffers: list[torch.Tensor], offset: int, decay: bool, record: StepRecord,
                 s: StepScalars, config: ZOConfig, threshold: float):
    """One step of `config.optimizer` on a CPU tensor at `offset`, in eager torch: (p, buffers)."""
    zds = [update.cast_perturbation(perturbation(seed, offset, p.numel(), config.perturbation, "cpu"), p.dtype)
           for seed in perturbation_seeds(record.seed, len(record.grads))]
    return update.step_tensor(p, buffers, zds, s, decay, config.optimizer, threshold)


def trainer_phases(stepper: KernelStepper, record: StepRecord, s: StepScalars) -> None:
    """A step the way the trainer runs it on the kernels (ZO-SGD-Cons: one launch per move)."""
    for j, seed in enumerate(perturbation_seeds(record.seed, len(record.grads))):
        stepper.perturb(seed, s.plus, first=j == 0, thresholds=record.extras)
        stepper.perturb(seed, s.minus, first=False)
        stepper.perturb(seed, s.plus, first=False)
    if record.optimizer == "zo-sgd-cons":
        for move in s.moves:
            stepper.update(record.seed, s.with_moves(move))
    else:
        stepper.update(record.seed, s)


def guard_record(step: int, seed: int, config: ZOConfig, thresholds: tuple[float, ...]) -> StepRecord:
    """The sample's record of `step`: q gradients; ZO-SGD-Cons takes each decision in turn."""
    more = tuple(0.731 * (-0.5) ** j for j in range(1, config.num_perturbations))
    decision = (step + 1) % 3 if config.optimizer == "zo-sgd-cons" else 0
    return StepRecord(step, seed, 0.731, 1e-2, 1e-2, 0, config.optimizer, thresholds, more, decision)


def _sample(dtype: torch.dtype, kinds: int):
    """The sample's parameters and, per tensor, its `kinds` float32 buffers."""
    gen = torch.Generator().manual_seed(1234)
    params = [(torch.randn(n, generator=gen) * 0.05).to(dtype) for _, n, _ in SAMPLE]
    params[1][:3] = torch.tensor([0.0, -0.0, 1e-30])  # zeros and an underflowing value
    return params, [[torch.zeros(n) for _ in range(kinds)] for _, n, _ in SAMPLE]


def _compare(label: str, got: torch.Tensor, want: torch.Tensor, mismatches: list[str]) -> None:
    got = got.cpu()
    if not torch.equal(got.view(-1), want.view(-1)):
        diff = (got.view(-1) != want.view(-1)).nonzero()
        first = int(diff[0]) if len(diff) else -1
        mismatches.append(f"{label}: {len(diff)} of {want.numel()} elements differ (first at {first}: "
                          f"kernel {got.view(-1)[first].item()!r}, oracle {want.view(-1)[first].item()!r})")


def _run_checks(device: torch.device, dtypes: Sequence[torch.dtype], config: ZOConfig) -> tuple[list[str], int]:
    mismatches, checks = [], 0
    config = config.model_copy(update={"weight_decay": config.weight_decay or 0.05})
    kinds = moment_prefixes(config.optimizer)
    segments = [Segment(o, n, d) for o, n, d in SAMPLE]
    for o, n, _ in SAMPLE:
        for seed in SEEDS:
            z = perturbation_triton(seed, o, n, config.perturbation, device)
            _compare(f"z (seed {seed:#x}, offset {o})", z, perturbation(seed, o, n, config.perturbation), mismatches)
            checks += 1
    for dtype in dtypes:
        name = REPLAYED[dtype]
        want, want_buffers = _sample(dtype, len(kinds))
        # copies (`.to` would alias the CPU sample on a CPU device)
        params = {path: [p.to(device, copy=True) for p in want] for path in ("trainer", "replay")}
        buffers = {path: [[b[k].to(device, copy=True) for b in want_buffers] for k in range(len(kinds))]
                   for path in params}
        steppers = {path: KernelStepper(segments, params[path], *(buffers[path] + [[], []])[:2], config)
                    for path in params}
        for step, seed in enumerate(SEEDS):
            thresholds = sparse_thresholds(want, config.sparsity) if config.optimizer == "sparse-mezo" else ()
            record = guard_record(step, seed, config, thresholds)
            s = StepScalars.of(record, config)
            for i, (o, _, d) in enumerate(SAMPLE):
                threshold = thresholds[i] if thresholds else 0.0
                want[i], want_buffers[i] = _oracle_step(want[i], want_buffers[i], o, d, record, s, config, threshold)
            trainer_phases(steppers["trainer"], record, s)
            steppers["replay"].replay_step(record, s)
            for path in params:
                for i, (o, n, _) in enumerate(SAMPLE):
                    where = f"{name} {path} step {step} (offset {o}, {n} elements)"
                    _compare(f"{where} parameter", params[path][i], want[i], mismatches)
                    checks += 1
                    for k, prefix in enumerate(kinds):
                        _compare(f"{where} {prefix.removeprefix('optimizer.').rstrip('.')}", buffers[path][k][i],
                                 want_buffers[i][k], mismatches)
                        checks += 1
    return mismatches, checks


def check_kernels(device: torch.device | str, dtypes: Sequence[torch.dtype], config: ZOConfig) -> KernelCheck:
    """Run the kernels on the sample against the CPU oracle; never raises (a failure is a failed check)."""
    device = torch.device(device)
    dtypes = tuple(sorted(set(dtypes), key=lambda d: REPLAYED[d]))
    names = tuple(REPLAYED[d] for d in dtypes)
    key = (str(device), names, config.optimizer, config.perturbation, config.weight_decay > 0, config.betas,
           config.adam_eps, config.sparsity, config.momentum, config.num_perturbations)
    if key in _cache:
        return _cache[key]
    if not triton_kernels.available():
        result = KernelCheck("eager", None, str(device), names, reason="triton is not installed")
        _cache[key] = result
        return result
    began = time.perf_counter()
    try:
        mismatches, checks = _run_checks(device, dtypes, config)
    except Exception as e:  # a kernel that does not compile or run is a failed check, not a failed job
        mismatches, checks = [f"the kernels failed: {type(e).__name__}: {e}"], 0
    passed = not mismatches
    result = KernelCheck("triton" if passed else "eager", passed, str(device), names, tuple(mismatches[:20]),
                         "the kernels match the CPU oracle" if passed else
                         "the kernels differ from the CPU oracle; using the eager path",
                         time.perf_counter() - began, checks)
    if not passed:
        logger.error("zocheck-ray: the GPU kernels on %s give other bits than the CPU oracle (%d differences, "
                     "first: %s); the trainer falls back to the eager path (slower, exact)",
                     device, len(mismatches), mismatches[0])
    _cache[key] = result
    return result


def kernels_usable(device: torch.device, dtypes: Sequence[torch.dtype], config: ZOConfig | None = None) -> bool:
    """Whether the kernels passed the guard on `device` (checking them now if not yet checked)."""
    return check_kernels(device, dtypes, config or ZOConfig()).passed is True
