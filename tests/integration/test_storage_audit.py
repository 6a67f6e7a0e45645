"""`zocheck-ray verify` / `audit_run` / `verify_run` (issue 12): proof from what retention kept.

A real `ZOOptimizer` trains; its records go to a `StepLog` (small sealed segments,
collected below the oldest retained snapshot) and its state to a `SnapshotStore`.
The audit must start at the oldest retained snapshot whose log is complete, prove the
range through every later snapshot and hashed step, and name what was altered.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from zocheck_ray.cli import main
from zocheck_ray.config import JobConfig
from zocheck_ray.core import ZOConfig, ZOOptimizer, state_hash
from zocheck_ray.storage import Lease, SnapshotStore, StepLog, audit_run
from zocheck_ray.storage.steplog import SEGMENT_MAGIC, list_segments, parse_segment
from zocheck_ray.storage.snapshot import snapshot_dir
from zocheck_ray.verify import verify_run
from zocheck_ray.workload.models import build_model, trainable_parameters

CONFIG = ZOConfig(optimizer="zo-adam", lr=1e-2, eps=1e-3)


def make_params() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [("w", (torch.randn(16, 12, generator=gen) * 0.1)), ("b", torch.zeros(16))]


class Run:
    """Trains, logs every step, snapshots every `every` steps and collects the log as the shadow does."""

    def __init__(self, url, options=None, *, params=None, config=CONFIG, every=5, seal_records=3, keep=2):
        self.url, self.options, self.config, self.every = url, options, config, every
        self.params = params or make_params()
        self.opt = ZOOptimizer(self.params, config)
        self.lease = Lease(url, options, owner="test-writer").acquire()
        self.store = SnapshotStore(url, options, keep=keep, lease=self.lease)
        self.log = StepLog(url, options, seal_records=seal_records, lease=self.lease)
        self.hashes = {0: state_hash(self.opt.state_tensors())}
        self.snapshot()

    def loss(self) -> float:
        return float(sum(((p.float() * 1.5 + 0.1 * i) ** 2).sum() for i, (_, p) in enumerate(self.params)))

    def snapshot(self) -> None:
        frozen = {k: v.clone() for k, v in self.opt.state_tensors().items()}
        self.store.save(self.opt.step_index, frozen, {"run_id": "audit", "zo_config": self.config})
        self.log.collect_garbage(keep_from_step=self.store.committed()[-1].step)

    def step(self, n: int) -> "Run":
        for _ in range(n):
            self.log.append(self.opt.step(self.loss, seed=104729 * self.opt.step_index + 3))
            self.log.flush()
            self.hashes[self.opt.step_index] = state_hash(self.opt.state_tensors())
            if self.opt.step_index % self.every == 0:
                self.snapshot()
        return self

    def close(self) -> "Run":
        self.log.close()
        return self


def test_after_a_collected_log_the_audit_starts_at_the_oldest_retained_snapshot(root):
    url, options = root
    run = Run(url, options).step(23).close()
    assert list_segments(run.log.storage)[0].first_step > 0  # the log from step 0 is gone
    audit = audit_run(url, options, expected=run.hashes, final_step=23, final_hash=run.hashes[23])
    assert audit.verified, audit.mismatches
    assert (audit.first_step, audit.last_step, audit.snapshots_checked) == (15, 23, [15, 20])
    assert audit.records_replayed == 8 and audit.hashed_steps_checked == 9  # steps 15..23
    assert audit.describe() == "steps 15..23 proven: 2 snapshots, 8 records, 0 mismatches"


def test_a_gap_where_a_recovery_resumed_starts_the_audit_after_it(tmp_path):
    url = str(tmp_path / "run")
    run = Run(url, every=5, keep=3).step(15)  # snapshots 5, 10, 15
    # As after a host failure: records 12..14 never became durable, and the log continues at
    # the snapshot of step 15 that a recovered trainer resumed from.
    run.log.close()
    run.log = StepLog(url, seal_records=3, resume_step=15, lease=run.lease)
    for seg in list_segments(run.log.storage):
        data = run.log.storage.read_bytes(seg.rel)
        records, _ = parse_segment(data, seg, seg.rel, torn_tail_ok=not seg.sealed)
        if records and records[-1].step >= 12:  # cut the log back to step 11: a gap 12..14 remains
            kept = [r for r in records if r.step < 12]
            run.log.storage.write_atomic(seg.rel, SEGMENT_MAGIC + b"".join(r.to_bytes() for r in kept))
    run.step(5).close()
    audit = audit_run(url)
    assert audit.verified, audit.mismatches
    assert (audit.first_step, audit.last_step, audit.snapshots_checked) == (15, 20, [15, 20])
    assert any("snapshot at step 10 is not a start" in note for note in audit.notes)


def test_an_altered_record_is_found_between_two_snapshots(tmp_path):
    url = str(tmp_path / "run")
    run = Run(url).step(20).close()
    storage = run.log.storage
    seg = next(s for s in list_segments(storage) if s.first_step <= 17 < s.first_step + 3)
    records, _ = parse_segment(storage.read_bytes(seg.rel), seg, seg.rel, torn_tail_ok=False)
    forged = [dataclasses.replace(r, projected_grad=r.projected_grad * 2) if r.step == 17 else r for r in records]
    storage.write_atomic(seg.rel, SEGMENT_MAGIC + b"".join(r.to_bytes() for r in forged))  # CRCs valid

    audit = audit_run(url, expected=run.hashes)
    assert not audit.verified
    assert audit.mismatches[0] == ("the log replayed from step 15 to step 18 differs from the trainer's state at "
                                   "step 18: a record of steps 15..17 was altered")
    assert "the snapshot at step 20" in audit.mismatches[1] and len(audit.mismatches) == 2
    assert audit.describe().startswith("steps 15..20 NOT proven: 2 snapshots, 5 records, 2 mismatches")
    assert not audit_run(url).verified  # without the trainer's hashes, the snapshot at step 20 still tells


def test_a_damaged_later_snapshot_is_named(tmp_path):
    url = str(tmp_path / "run")
    Run(url).step(20).close()
    path = os.path.join(url, snapshot_dir(20), "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 3)
        f.write(b"\xff\xff\xff")
    audit = audit_run(url)
    assert not audit.verified
    assert any("snapshot at step 20 is damaged" in m and "model.safetensors" in m for m in audit.mismatches)


def test_verify_command_proves_a_run_on_s3_with_an_endpoint_url(s3_bucket, capsys):
    url, options = s3_bucket
    Run(url, options).step(12).close()
    assert main(["verify", url, "--endpoint-url", options["endpoint_url"]]) == 0
    out = capsys.readouterr().out
    assert "steps 5..12 proven: 2 snapshots, 7 records, 0 mismatches" in out


def test_verify_command_exits_1_on_damage_and_2_on_unusable_storage(tmp_path, capsys):
    url = str(tmp_path / "run")
    Run(url).step(10).close()
    os.remove(os.path.join(url, snapshot_dir(10), "model.safetensors"))
    assert main(["verify", url]) == 1
    assert "MISMATCH: the snapshot at step 10 is damaged" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "nothing-here")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("keep_whole_log", [True, False], ids=["whole-log", "collected-log"])
def test_verify_run_checks_a_job_from_what_storage_kept(tmp_path, keep_whole_log):
    job = JobConfig(model="tiny-opt", storage=str(tmp_path / "runs"), run_id="verify-1",
                    zo=ZOConfig(lr=1e-3, eps=1e-3), hash_every_step=True)
    model = build_model(job.model, job.dtype, seed=job.run_seed)
    params = [(n, p.data) for n, p in trainable_parameters(model)]
    run = Run(job.run_url, params=params, config=job.zo, every=3, seal_records=1000 if keep_whole_log else 2)
    run.step(7).close()
    summary = SimpleNamespace(steps=7, step_hashes=run.hashes, final_state_hash=run.hashes[7])
    result = verify_run(job, summary)
    assert result.verified, result.mismatches
    assert result.from_initial_state is keep_whole_log
    assert (result.proven_from_step, result.proven_to_step) == ((0 if keep_whole_log else 3), 7)
    assert result.recovery_image_step == 7
    assert result.audit == "steps 3..7 proven: 2 snapshots, 4 records, 0 mismatches"


def test_a_damaged_manifest_is_named_not_skipped(tmp_path, caplog):
    url = str(tmp_path / "run")
    Run(url).step(10).close()
    path = os.path.join(url, snapshot_dir(10), "manifest.json")
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"#")
    audit = audit_run(url)
    assert not audit.verified
    assert any("manifest is damaged" in m and f"{snapshot_dir(10)}/manifest.json" in m for m in audit.mismatches)


def test_a_collected_log_is_not_reported_as_a_gap(tmp_path, caplog):
    url = str(tmp_path / "run")
    Run(url).step(12).close()
    with caplog.at_level("WARNING"):
        assert audit_run(url).verified
    assert "gap" not in caplog.text


def test_damage_in_a_log_segment_is_named_by_its_first_unreadable_step_and_byte(tmp_path, capsys):
    # one segment holds steps 0..39; snapshots every 10 steps; the record of step 14 is damaged. Every start
    # after it meets the damage too (the segment is read from its start): the report names step 14 and its
    # byte, once, not the step where a read began
    url = str(tmp_path / "run")
    run = Run(url, every=10, seal_records=100, keep=10).step(40).close()
    storage = run.log.storage
    (seg,) = list_segments(storage)
    data = bytearray(storage.read_bytes(seg.rel))
    records, _ = parse_segment(bytes(data), seg, seg.rel, torn_tail_ok=False)
    offset = len(SEGMENT_MAGIC) + sum(len(r.to_bytes()) for r in records[:14])
    data[offset + 12] ^= 0xFF  # inside the record of step 14: its CRC no longer matches
    storage.write_atomic(seg.rel, bytes(data))

    audit = audit_run(url)
    assert not audit.verified
    damage = [m for m in audit.mismatches if "damaged" in m]
    assert len(damage) == 1, audit.mismatches
    assert damage[0].startswith(f"the log is damaged at step 14 (byte {offset} of {storage.url_of(seg.rel)}): no "
                                "record from step 14 on is replayed"), damage[0]
    assert main(["verify", url]) == 1
    assert f"MISMATCH: the log is damaged at step 14 (byte {offset} of " in capsys.readouterr().out
