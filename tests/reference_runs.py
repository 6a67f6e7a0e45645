"""Shared by the Ray tests: the run that would have happened, and how exactness is checked."""

from zocheck_ray.config import JobConfig
from zocheck_ray.testing.reference import uninterrupted_data_parallel_hashes, uninterrupted_hashes  # noqa: F401

STEPS = 36
SMALL_TASK = dict(batch_size=4, max_length=32, eval_size=16, eval_interval=10)
"""The shipped sentiment task, small: 4 rows a step, 16 held-out rows evaluated every 10 steps (and at the
last step), so the evaluations run between the steps whose hashes are checked."""


GROUPS = ("shadow", "durability", "failure", "scaling")
"""`JobConfig`'s grouped settings: `job_for(..., shadow={"max_lag_steps": 2})` merges into the defaults."""


def job_for(tmp_path, optimizer="zo-sgd", dtype="fp32", **kw) -> JobConfig:
    fields = dict(steps=STEPS, storage=str(tmp_path), shadow=dict(snapshot_interval=8), log_interval=6,
                  hash_every_step=True, dtype=dtype,
                  zo=dict(optimizer=optimizer, lr=2e-3, eps=1e-2 if dtype != "fp32" else 1e-3), task=SMALL_TASK)
    for key, value in kw.items():
        fields[key] = {**fields.get(key, {}), **value} if key in GROUPS else value
    return JobConfig.model_validate(fields)


def assert_exact(summary, expected, steps: int = STEPS):
    assert summary.steps == steps
    assert summary.final_state_hash == expected[steps]
    assert summary.shadow_state_hash == expected[steps]
    assert summary.step_hashes, "per-step hashes were recorded"
    for step, digest in summary.step_hashes.items():
        assert digest == expected[step], f"state after step {step} differs"
