"""Check a finished run against its durable storage: is what was logged what was trained?

    summary = zocheck_ray.run(job, fail_at=[120])
    result = verify_run(job, summary)      # `zocheck-ray train --verify` does this
    assert result.verified

Two independent rebuilds, each compared by `state_hash` with what the trainer had:

- **log replay**: the job's initial state (the model built from `model` and `run_seed`,
  as every trainer builds it) with the whole durable step log replayed onto it by
  the fused kernel, step by step. Its hash must equal the trainer's after every
  step the summary holds a hash for (with `hash_every_step`: every step, including
  the state a recovered trainer resumed from) and after the last step.
- **recovery image**: `zocheck_ray.storage.recovery_image`, the newest committed
  snapshot plus the log suffix after it: what a host failure would recover. It
  must be at the last step with the trainer's final hash.

Nothing here trusts the shadow's memory: both read only durable storage.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

from zocheck_ray.config import JobConfig
from zocheck_ray.core import ZOOptimizer, replay, state_hash
from zocheck_ray.storage import read_log, recovery_image
from zocheck_ray.workload.models import build_model, trainable_parameters


class Verification(BaseModel):
    model_config = ConfigDict(extra="forbid")

    verified: bool
    """True when every compared hash matched."""
    log_records: int
    """Records in the durable step log (steps 0 .. log_records - 1)."""
    steps_checked: int
    """Steps whose replayed state was compared with the trainer's state_hash."""
    recovery_image_step: int
    """The step of the state rebuilt from the newest snapshot plus the log suffix."""
    mismatches: list[str]
    """What differed, one line each (empty when verified)."""
    seconds: float


def initial_state(job: JobConfig) -> dict:
    """The state every trainer of `job` starts from (canonical order, optimizer moments included)."""
    model = build_model(job.model, job.dtype, seed=job.run_seed)
    return {k: v.detach().clone() for k, v in ZOOptimizer(trainable_parameters(model), job.zo).state_tensors().items()}


def verify_run(job: JobConfig, summary) -> Verification:
    """Compare `summary` (a `RunSummary` of `job`) with a replay of `job`'s durable storage."""
    started = time.perf_counter()
    mismatches: list[str] = []
    records = read_log(job.run_url, after_step=-1, storage_options=job.storage_options)
    if len(records) != summary.steps:
        mismatches.append(f"the durable log holds {len(records)} records; the run took {summary.steps} steps")
    expected = dict(summary.step_hashes)
    expected[summary.steps] = summary.final_state_hash
    state = initial_state(job)
    checked = 0
    if 0 in expected:
        checked += 1
        if state_hash(state) != expected[0]:
            mismatches.append("the initial state differs from the trainer's step 0")
    for record in records:
        replay(state, [record], job.zo, start_step=record.step)
        step = record.step + 1
        if step in expected:
            checked += 1
            if state_hash(state) != expected[step]:
                mismatches.append(f"the log replayed to step {step} differs from the trainer's state there")
    image, image_step = recovery_image(job.run_url, storage_options=job.storage_options)
    if image_step != summary.steps:
        mismatches.append(f"the newest durable image is at step {image_step}, not the last step {summary.steps}")
    elif state_hash(image) != summary.final_state_hash:
        mismatches.append(f"the durable image at step {image_step} differs from the trainer's final state")
    return Verification(verified=not mismatches, log_records=len(records), steps_checked=checked,
                        recovery_image_step=image_step, mismatches=mismatches,
                        seconds=time.perf_counter() - started)
