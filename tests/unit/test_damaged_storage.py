"""Damaged snapshots met on a resume: the newest set aside and written again, so storage is sound and the
durable step true; every snapshot damaged: refused at once (a missing or cut-short file before Ray starts),
naming them, deleting nothing, the lease released."""

from __future__ import annotations

import os

import pytest
import torch

from support import trained
from zocheck_ray.config import JobConfig
from zocheck_ray.core import state_hash
from zocheck_ray.runtime.shadow import Shadow
from zocheck_ray.storage import CorruptSnapshotError, SnapshotStore, read_lease, recover
from zocheck_ray.storage.fs import open_storage
from zocheck_ray.storage.snapshot import DAMAGED_DIR, snapshot_dir


@pytest.fixture
def job(tmp_path):
    return JobConfig(storage=str(tmp_path), shadow={"snapshot_interval": 4}, zo=dict(lr=1e-3, eps=1e-3))


def damage(job, step: int) -> str:
    path = os.path.join(job.run_url, snapshot_dir(step), "model.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-10] ^= 0xFF
    open(path, "wb").write(bytes(data))
    return path


def run_to(job, steps: int):
    initial, opt, records = trained(job, steps)
    shadow = Shadow(job)
    shadow.initialize(0, initial)
    shadow.push(b"".join(r.to_bytes() for r in records))
    shadow.drain(steps, timeout=120)
    assert shadow.close()
    return opt


def test_a_damaged_newest_snapshot_is_set_aside_and_written_again_on_resume(job):
    opt = run_to(job, 8)
    damage(job, 8)
    shadow = Shadow(job)  # rebuilt from an older snapshot and the log's records after it
    try:
        m = shadow.metrics()
        assert (m.source, m.replayed_step) == ("durable", 8) and m.durable_step < 8  # the durable step is true
        assert shadow.replica_hash() == (8, state_hash(opt.state_tensors()))
        assert os.listdir(os.path.join(job.run_url, DAMAGED_DIR))[0].startswith("step-000000000008-")
        assert shadow.drain(8, timeout=120).durable_step == 8  # true: written again, sound
    finally:
        shadow.close()
    store = SnapshotStore(job.run_url, create=False)
    store.check(8)
    assert state_hash(recover(store).state) == state_hash(opt.state_tensors())


def test_saving_a_step_again_over_its_damaged_snapshot_writes_it_anew(tmp_path):
    store = SnapshotStore(str(tmp_path / "run"))
    tensors = {"w": torch.arange(6, dtype=torch.float32)}
    store.save(5, tensors)
    damage(JobConfig(storage=str(tmp_path), run_id="run"), 5)
    with pytest.raises(CorruptSnapshotError):
        store.check(5)
    store.save(5, tensors)
    assert store.check(5).state_hash == state_hash(tensors)
    assert len(os.listdir(tmp_path / "run" / DAMAGED_DIR)) == 1  # set aside, not deleted


def test_storage_whose_every_snapshot_is_damaged_is_refused_at_once_and_kept(job):
    run_to(job, 8)
    damaged = [damage(job, info.step) for info in SnapshotStore(job.run_url, create=False).committed()]
    assert len(damaged) == 2
    with pytest.raises(CorruptSnapshotError, match="every committed snapshot under .* is corrupt: .*nothing was "
                                                   "deleted") as refused:
        Shadow(job)
    assert "did not answer" not in str(refused.value)  # damage is not retried as an outage
    assert all(os.path.exists(path) for path in damaged)
    assert read_lease(open_storage(job.run_url, create=False)).released


def test_the_resume_point_is_read_before_ray_so_an_injected_failure_lies_after_it(job):
    from zocheck_ray.control.startup import resume_step as resume_point

    assert resume_point(job) is None  # a fresh run
    run_to(job, 8)
    assert resume_point(job) == 8


def test_storage_whose_every_snapshot_lacks_a_file_or_is_cut_short_is_refused_before_ray(job, tmp_path, capsys):
    from zocheck_ray.cli import main

    run_to(job, 8)
    newest, older = (os.path.join(job.run_url, snapshot_dir(info.step), "model.safetensors")
                     for info in SnapshotStore(job.run_url, create=False).committed())
    os.truncate(newest, os.path.getsize(newest) // 2)
    os.remove(older)
    (tmp_path / "job.yaml").write_text(f"run_id: {job.run_id}\n")
    assert main(["train", "--config", str(tmp_path / "job.yaml"), "--storage", str(tmp_path)]) == 2  # no Ray
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"cannot be resumed: every committed snapshot under {job.run_url} is damaged: {newest} holds " in err
    assert f"{older} is missing; nothing was deleted: restore the damaged files from a copy" in err
    assert os.path.exists(newest) and read_lease(open_storage(job.run_url, create=False)).released
