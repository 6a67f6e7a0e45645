"""Shared by test_triton_kernels.py (interpreter, CPU) and test_cuda.py (compiled, CUDA).

`run_kernels` runs two steps through the Triton kernels, the trainer's way (perturb x3
then update) and the replay's way (one launch per step), on tensors at chosen global
offsets; `run_oracle` computes the same two steps with the eager oracle on the CPU,
written here from `update.py` and `generator.py` directly (not through the guard's code).
"""

from __future__ import annotations

import torch

from zocheck_ray.core.dtypes import JOB_DTYPES
from zocheck_ray import ZOConfig
from zocheck_ray.core import update
from zocheck_ray.core.generator import perturbation
from zocheck_ray.core.layout import moment_prefixes
from zocheck_ray.core.seeds import perturbation_seeds
from zocheck_ray.core.update import sparse_thresholds
from zocheck_ray.core.record import StepRecord
from zocheck_ray.core.scalars import StepScalars

OPTIMIZERS = ["zo-sgd", "zo-adam", "sparse-mezo", "zo-sgd-sign", "zo-signsgd", "zo-sgd-mmt", "zo-sgd-cons"]
DTYPES = JOB_DTYPES
KINDS = ["gaussian", "rademacher"]
SEGMENTS = [(0, 7, True), (7, 1, False), (2**32 - 5, 613, True), (3 * 2**32 + 2, 1030, False)]
"""(global offset, numel, decay): odd sizes, lanes 0-3, a tensor across 2**32, one beyond."""
SEEDS = [11, 2**64 - 2]


def config_for(optimizer: str, kind: str, weight_decay: float = 0.1, q: int = 1) -> ZOConfig:
    return ZOConfig(optimizer=optimizer, perturbation=kind, lr=3e-2, eps=2e-2, weight_decay=weight_decay,
                    sparsity=0.5, momentum=0.8, num_perturbations=q)


def initial(dtype: torch.dtype, kinds: int):
    """Parameters, then the first and second kind of float32 buffer per tensor (empty lists where none)."""
    gen = torch.Generator().manual_seed(7)
    params = [(torch.randn(n, generator=gen) * 0.2).to(dtype) for _, n, _ in SEGMENTS]
    params[3][:4] = torch.tensor([0.0, -0.0, 3e-8, -6e-5])  # zeros, fp16 subnormals
    buffers = [[torch.zeros(n) for _, n, _ in SEGMENTS] for _ in range(kinds)] + [[], []]
    return params, buffers[0], buffers[1]


def record_at(config: ZOConfig, step: int, params) -> StepRecord:
    """Step `step`'s record (Sparse-MeZO's thresholds from `params`, the values at the step's start; q
    gradients; ZO-SGD-Cons' decision: the ascent step, then back to the start)."""
    extras = sparse_thresholds(params, config.sparsity) if config.optimizer == "sparse-mezo" else ()
    more = tuple((-1) ** (step + j) * 0.41 * j for j in range(1, config.num_perturbations))
    decision = (2, 0)[step] if config.optimizer == "zo-sgd-cons" else 0
    return StepRecord(step, SEEDS[step], (-1) ** step * 1.37, config.lr, config.eps, 0, config.optimizer, extras,
                      more, decision)


def run_oracle(config: ZOConfig, dtype: torch.dtype):
    """(params, first buffers, second buffers, records) after two eager steps on the CPU, written from
    `update.py`'s operations: the 3q perturbations, the estimate, the optimizer's update."""
    kinds = len(moment_prefixes(config.optimizer))
    params, first, second = initial(dtype, kinds)
    records = []
    for step, seed in enumerate(SEEDS):
        record = record_at(config, step, params)
        records.append(record)
        s = StepScalars.of(record, config)
        for i, (offset, n, decay) in enumerate(SEGMENTS):
            zds = [update.cast_perturbation(perturbation(sj, offset, n, config.perturbation), dtype)
                   for sj in perturbation_seeds(seed, config.num_perturbations)]
            x = params[i].float()
            mask = update.sparse_mask(x, record.extras[i]) if record.extras else None
            x = update.perturb_all(x, zds, s, dtype, mask)
            a = update.estimate(zds, s)
            if config.optimizer == "zo-adam":
                x, first[i], second[i] = update.adam_update(x, first[i], second[i], a, s, decay, dtype)
            elif config.optimizer == "zo-sgd-mmt":
                x, first[i] = update.momentum_update(x, first[i], a, s, decay, dtype)
            else:
                start = x
                for c in s.moves:
                    x = update.sgd_move(x, a, c, s, decay, dtype, sign_of=config.optimizer == "zo-signsgd")
                x = x if mask is None else torch.where(mask, x, start)
            params[i] = x.to(dtype)
    return params, first, second, records


def run_kernels(config: ZOConfig, dtype: torch.dtype, records, device, path: str):
    """The kernels' (params, first buffers, second buffers) after `records`, on `device`, the `path` way."""
    from zocheck_ray.core.gpu.kernel_guard import trainer_phases
    from zocheck_ray.core.gpu.triton_kernels import KernelStepper, Segment

    kinds = len(moment_prefixes(config.optimizer))
    params, ms, vs = (list(t.to(device, copy=True) for t in group) for group in initial(dtype, kinds))
    stepper = KernelStepper([Segment(*s) for s in SEGMENTS], params, ms, vs, config)
    for record in records:
        s = StepScalars.of(record, config)
        if path == "replay":
            stepper.replay_step(record, s)
        else:
            trainer_phases(stepper, record, s)
    return [t.cpu() for t in params], [t.cpu() for t in ms], [t.cpu() for t in vs]


def assert_equal_lists(got, want, what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype, f"{what}[{i}]"
        assert torch.equal(g, w), f"{what}[{i}] (offset {SEGMENTS[i][0]}): {(g != w).sum().item()} elements differ"
