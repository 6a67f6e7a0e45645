"""Check a finished run against its durable storage: is what was logged what was trained?

    summary = zocheck_ray.run(job, fail_at=[120])
    result = verify_run(job, summary)      # as `zocheck-ray train --verify`
    assert result.verified
    print(result.audit)                    # steps 150..300 proven: 2 snapshots, 150 records, 0 mismatches

Three independent rebuilds from durable storage, each compared by `state_hash` with what the
trainer had: the audit (`storage.audit_run`); the initial state with the whole log replayed,
while the log still starts at step 0; and `recover_state`'s image at the last step.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

from zocheck_ray.config import JobConfig
from zocheck_ray.core import ZOOptimizer, replay, state_hash
from zocheck_ray.storage import CorruptLogError, open_storage, recover_state
from zocheck_ray.storage.audit import audit_run
from zocheck_ray.storage.steplog import first_logged_step, read_records
from zocheck_ray.workload.adapters import build_trainable


class Verification(BaseModel):
    model_config = ConfigDict(extra="forbid")

    verified: bool
    """True when every compared hash matched and a step range was proven."""
    proven_from_step: int | None
    """The step of the snapshot the audit started from (0 when checked from the initial state too)."""
    proven_to_step: int | None
    """The last step the audit's replay reached."""
    snapshots_checked: int
    """Committed snapshots loaded and compared by the audit."""
    log_records: int
    """Records replayed: from step 0 when the log is complete from there, else from the audit's snapshot."""
    from_initial_state: bool
    """Whether the log still held every record from step 0, so the initial state was replayed too."""
    steps_checked: int
    """Distinct steps whose replayed state was compared with the trainer's state_hash."""
    recovery_image_step: int
    """The step of the state rebuilt from the newest snapshot plus the log suffix."""
    audit: str
    """The audit's one-line account: the step range proven, or why not."""
    mismatches: list[str]
    """What differed, one line each (empty when verified)."""
    seconds: float


def initial_state(job: JobConfig) -> dict:
    """The state every trainer of `job` starts from (canonical order, optimizer moments included)."""
    built = build_trainable(job.model, job.dtype, job.run_seed, job.peft, quantization=job.quantization)
    # The model's own tensors (not copies): the model is dropped, so this is the one copy of the state.
    return {k: v.detach() for k, v in ZOOptimizer(built.parameters, job.zo).state_tensors().items()}


def verify_run(job: JobConfig, summary) -> Verification:
    """Compare `summary` (a `RunSummary` of `job`) with a replay of `job`'s durable storage."""
    started = time.perf_counter()
    expected = dict(summary.step_hashes)
    expected[summary.steps] = summary.final_state_hash
    audit = audit_run(job.run_url, job.storage_options, expected=summary.step_hashes, final_step=summary.steps,
                      final_hash=summary.final_state_hash, config=job.zo)
    mismatches = list(audit.mismatches)
    compared = set() if audit.first_step is None else {
        s for s in expected if audit.first_step <= s <= audit.last_step}
    log_records = audit.records_replayed

    storage = open_storage(job.run_url, job.storage_options, create=False)
    records = []
    if first_logged_step(storage) == 0:  # else retention collected the log's start: the audit is the proof
        try:
            records = read_records(storage, after_step=-1)
        except CorruptLogError as exc:
            records = exc.records  # the audit names the damage
    from_initial = len(records) >= summary.steps
    if from_initial:
        records = records[:summary.steps]
        log_records = len(records)
        state = initial_state(job)
        if 0 in expected:
            compared.add(0)
            if state_hash(state) != expected[0]:
                mismatches.append("the initial state differs from the trainer's step 0")
        position = 0
        for stop in sorted(s for s in expected if 0 < s <= summary.steps):
            replay(state, records[position:stop], job.zo, start_step=position)
            position = stop
            compared.add(stop)
            if state_hash(state) != expected[stop]:
                mismatches.append(f"the log replayed from the initial state to step {stop} differs from the "
                                  "trainer's state there")
        del state  # one copy of the state at a time

    image, image_step = recover_state(job.run_url, storage_options=job.storage_options)
    if image_step != summary.steps:
        mismatches.append(f"the newest durable image is at step {image_step}, not the last step {summary.steps}")
    elif state_hash(image) != summary.final_state_hash:
        mismatches.append(f"the durable image at step {image_step} differs from the trainer's final state")
    return Verification(verified=audit.first_step is not None and not mismatches,
                        proven_from_step=0 if from_initial else audit.first_step,
                        proven_to_step=audit.last_step, snapshots_checked=len(audit.snapshots_checked),
                        log_records=log_records, from_initial_state=from_initial, steps_checked=len(compared),
                        recovery_image_step=image_step, audit=audit.describe(), mismatches=mismatches,
                        seconds=time.perf_counter() - started)
