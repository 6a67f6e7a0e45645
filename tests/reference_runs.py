"""Shared by the Ray tests: the run that would have happened, and how exactness is checked."""

from zocheck_ray.config import JobConfig
from zocheck_ray.core import ZOOptimizer, state_hash
from zocheck_ray.workload.data import step_seed
from zocheck_ray.workload.models import build_model, trainable_parameters
from zocheck_ray.workload.tasks import build_task

STEPS = 36
SMALL_TASK = dict(batch_size=4, max_length=32, eval_size=16, eval_interval=10)
"""The shipped sentiment task, small: 4 rows a step, 16 held-out rows evaluated every 10 steps (and at the
last step), so the evaluations run between the steps whose hashes are checked."""


def uninterrupted_hashes(job: JobConfig) -> dict[int, str]:
    """The run that would have happened: a plain loop, no Ray, no failures."""
    model = build_model(job.model, job.dtype, seed=job.run_seed)
    opt = ZOOptimizer(trainable_parameters(model), job.zo)
    task = build_task(job.task, job.model)
    hashes = {0: state_hash(opt.state_tensors())}
    for t in range(job.steps):
        opt.step(task.closure(model, t), seed=step_seed(job.run_seed, t))
        hashes[t + 1] = state_hash(opt.state_tensors())
    return hashes


def job_for(tmp_path, optimizer="zo-sgd", dtype="fp32", **kw) -> JobConfig:
    fields = dict(steps=STEPS, storage=str(tmp_path), snapshot_interval=8, log_interval=6, hash_every_step=True,
                  dtype=dtype, zo=dict(optimizer=optimizer, lr=2e-3, eps=1e-2 if dtype != "fp32" else 1e-3),
                  task=SMALL_TASK)
    fields.update(kw)
    return JobConfig.model_validate(fields)


def assert_exact(summary, expected):
    assert summary.steps == STEPS
    assert summary.final_state_hash == expected[STEPS]
    assert summary.shadow_state_hash == expected[STEPS]
    assert summary.step_hashes, "per-step hashes were recorded"
    for step, digest in summary.step_hashes.items():
        assert digest == expected[step], f"state after step {step} differs"


def uninterrupted_data_parallel_hashes(job: JobConfig) -> dict[int, str]:
    """The k-rank run that would have happened, as one plain loop: each step evaluates the k slices of its
    batch in rank order and forms the losses from their (sum, count) pairs added in rank order in float64."""
    k = job.trainers
    model = build_model(job.model, job.dtype, seed=job.run_seed)
    opt = ZOOptimizer(trainable_parameters(model), job.zo)
    task = build_task(job.task, job.model)

    def losses(plus, minus):
        totals = [0.0, 0.0, 0.0, 0.0]
        for pair_plus, pair_minus in zip(plus, minus):
            for i, value in enumerate((*pair_plus, *pair_minus)):
                totals[i] += value
        return totals[0] / totals[1], totals[2] / totals[3]

    hashes = {0: state_hash(opt.state_tensors())}
    for t in range(job.steps):
        slices = [task.batch_slice(t, r, k) for r in range(k)]
        opt.step(lambda: [task.loss_sum(model, b) for b in slices], seed=step_seed(job.run_seed, t), combine=losses)
        hashes[t + 1] = state_hash(opt.state_tensors())
    return hashes
