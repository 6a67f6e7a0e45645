"""Shared by test_triton_kernels.py (interpreter, CPU) and test_cuda.py (compiled, CUDA).

`run_kernels` runs two steps through the Triton kernels, the trainer's way (perturb x3
then update) and the replay's way (one launch per step), on tensors at chosen global
offsets; `run_oracle` computes the same two steps with the eager oracle on the CPU,
written here from `update.py` and `generator.py` directly (not through the guard's code).
"""

from __future__ import annotations

import torch

from zocheck_ray import ZOConfig
from zocheck_ray.core import update
from zocheck_ray.core.generator import perturbation
from zocheck_ray.core.update import sparse_thresholds
from zocheck_ray.core.record import StepRecord
from zocheck_ray.core.scalars import StepScalars

OPTIMIZERS = ["zo-sgd", "zo-adam", "sparse-mezo"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = ["gaussian", "rademacher"]
SEGMENTS = [(0, 7, True), (7, 1, False), (2**32 - 5, 613, True), (3 * 2**32 + 2, 1030, False)]
"""(global offset, numel, decay): odd sizes, lanes 0-3, a tensor across 2**32, one beyond."""
SEEDS = [11, 2**64 - 2]


def config_for(optimizer: str, kind: str, weight_decay: float = 0.1) -> ZOConfig:
    return ZOConfig(optimizer=optimizer, perturbation=kind, lr=3e-2, eps=2e-2, weight_decay=weight_decay,
                    sparsity=0.5)


def initial(dtype: torch.dtype, adam: bool):
    gen = torch.Generator().manual_seed(7)
    params = [(torch.randn(n, generator=gen) * 0.2).to(dtype) for _, n, _ in SEGMENTS]
    params[3][:4] = torch.tensor([0.0, -0.0, 3e-8, -6e-5])  # zeros, fp16 subnormals
    moments = [[torch.zeros(n) for _, n, _ in SEGMENTS] for _ in range(2)] if adam else [[], []]
    return params, moments[0], moments[1]


def record_at(config: ZOConfig, step: int, params) -> StepRecord:
    """Step `step`'s record (Sparse-MeZO's thresholds from `params`, the values at the step's start)."""
    extras = sparse_thresholds(params, config.sparsity) if config.optimizer == "sparse-mezo" else ()
    return StepRecord(step, SEEDS[step], (-1) ** step * 1.37, config.lr, config.eps, 0, config.optimizer, extras)


def run_oracle(config: ZOConfig, dtype: torch.dtype):
    """(params, exp_avg, exp_avg_sq, records) after two eager steps on the CPU."""
    adam = config.optimizer == "zo-adam"
    params, ms, vs = initial(dtype, adam)
    records = []
    for step, seed in enumerate(SEEDS):
        record = record_at(config, step, params)
        records.append(record)
        s = StepScalars.of(record, config)
        for i, (offset, n, decay) in enumerate(SEGMENTS):
            zd = update.cast_perturbation(perturbation(seed, offset, n, config.perturbation), dtype)
            x = params[i].float()
            mask = update.sparse_mask(x, record.extras[i]) if record.extras else None
            for c in (s.plus, s.minus, s.plus):
                x = update.perturb(x, zd, c, dtype, mask)
            if adam:
                x, ms[i], vs[i] = update.adam_update(x, ms[i], vs[i], zd, s, decay, dtype)
            else:
                x = update.sgd_update(x, zd, s, decay, dtype, mask)
            params[i] = x.to(dtype)
    return params, ms, vs, records


def run_kernels(config: ZOConfig, dtype: torch.dtype, records, device, path: str):
    """The kernels' (params, exp_avg, exp_avg_sq) after `records`, on `device`, the `path` way."""
    from zocheck_ray.core.triton_kernels import KernelStepper, Segment

    adam = config.optimizer == "zo-adam"
    params, ms, vs = (list(t.to(device, copy=True) for t in group) for group in initial(dtype, adam))
    stepper = KernelStepper([Segment(*s) for s in SEGMENTS], params, ms, vs, config)
    for record in records:
        s = StepScalars.of(record, config)
        if path == "replay":
            stepper.replay_step(record, s)
        else:
            stepper.perturb(record.seed, s.plus, first=True, thresholds=record.extras)
            stepper.perturb(record.seed, s.minus, first=False)
            stepper.perturb(record.seed, s.plus, first=False)
            stepper.update(record.seed, s)
    return [t.cpu() for t in params], [t.cpu() for t in ms], [t.cpu() for t in vs]


def assert_equal_lists(got, want, what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype, f"{what}[{i}]"
        assert torch.equal(g, w), f"{what}[{i}] (offset {SEGMENTS[i][0]}): {(g != w).sum().item()} elements differ"
