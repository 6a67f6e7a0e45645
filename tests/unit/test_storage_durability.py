"""Durable means seen on disk. The shadow's pipeline with real files: storage that changes under it (a log
deleted, replaced by a copy or mounted over, snapshots/ replaced, a committed file removed) is found at the next
commit and stops persistence in one line naming the path and the steps lost, reporting nothing durable after; a
store that refuses writes (an immutable directory) stops it after a few tries, a drain says so at once, and a
resume into it is refused before Ray; a full disk keeps its error while the durable snapshot stays behind, so
the run stops past the cost model's bound, and a drain whose lease lapsed on it is told at once; verify fails
where the log a manifest promises is gone or cut short. End to end on Ray: tests/integration/
test_storage_failures.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess

import pytest

from support import trained, wait_until
from zocheck_ray.config import JobConfig
from zocheck_ray.control.monitor import Monitor
from zocheck_ray.control.stop import StopRequest
from zocheck_ray.runtime.messages import KernelInfo, PublisherStats, TrainerProgress
from zocheck_ray.runtime.shadow import Shadow
from zocheck_ray.runtime.errors import StageError
from zocheck_ray.storage import SnapshotStore, read_lease
from zocheck_ray.storage.audit import audit_run
from zocheck_ray.storage.fs import open_storage


@pytest.fixture
def job(tmp_path):
    return JobConfig(storage=str(tmp_path), shadow={"snapshot_interval": 4}, zo=dict(lr=1e-3, eps=1e-3))


def push(shadow: Shadow, records) -> None:
    shadow.push(b"".join(r.to_bytes() for r in records))


def started(job, records, drained: int) -> Shadow:
    """A shadow whose state at `drained` is durable (snapshot and log), with the records up to there."""
    initial, _, _ = trained(job, 0)
    shadow = Shadow(job)
    shadow.initialize(0, initial)
    push(shadow, records[:drained])
    shadow.drain(drained, timeout=120)
    return shadow


def stopped(shadow: Shadow):
    assert wait_until(lambda: shadow.status().persist_stopped)
    return shadow.status()


def immutable(path) -> callable:
    """Make the directory `path` refuse new entries (root: `chattr +i`, which chmod does not do for root; else
    chmod); returns what undoes it."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        return lambda: os.chmod(path, 0o755)
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"chattr +i is refused here: {done.stderr.strip()}")
    return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)


# ------------------------------------------------------------------------------------ storage changed under the run


def test_a_log_deleted_under_the_shadow_stops_persistence_naming_the_steps_lost_and_nothing_stays_durable(job):
    _, _, records = trained(job, 14)
    shadow = started(job, records, 8)  # the log of steps 0..7 sealed, the snapshot of step 8
    try:
        push(shadow, records[8:10])
        assert wait_until(lambda: shadow.status().durable_log_step == 9)  # appended to log/seg-8.open
        shutil.rmtree(os.path.join(job.run_url, "log"))  # its open segment lives on, unlinked
        push(shadow, records[10:14])
        status = stopped(shadow)
        assert status.persist_stop_reason == "storage_lost"
        assert status.persist_error == (f"the durable step log lost steps 0..9: {job.run_url}/log/"
                                        f"seg-000000000000.zlog is gone; the run's storage changed under it")
        assert (status.durable_step, status.durable_log_step) == (None, None)  # vouched for no more
        with pytest.raises(StageError, match=r"^the image of step 14 and its log are not durable: the durable step "
                                             r"log lost steps 0\.\.9: "):
            shadow.drain(14, timeout=600)  # at once: nothing is retried
        assert not os.path.exists(os.path.join(job.run_url, "log"))  # not made again behind the loss
    finally:
        assert shadow.close()  # the lease is released
    assert read_lease(open_storage(job.run_url, create=False)).released


def test_a_log_directory_replaced_by_a_copy_is_found_by_its_inodes_not_its_names_or_sizes(job):
    _, _, records = trained(job, 12)
    shadow = started(job, records, 8)
    try:
        push(shadow, records[8:10])
        assert wait_until(lambda: shadow.status().durable_log_step == 9)
        log = os.path.join(job.run_url, "log")
        shutil.copytree(log, log + ".copy")  # the same names and bytes, other inodes
        os.rename(log, log + ".old")
        os.rename(log + ".copy", log)
        push(shadow, records[10:12])
        status = stopped(shadow)
        assert status.persist_error == (
            f"the durable step log lost steps 0..9: {job.run_url}/log/seg-000000000000.zlog names another file than "
            "the one written (it or a directory above it was deleted or replaced, or a file system was mounted over "
            "it); the run's storage changed under it")
    finally:
        shadow.close()


def test_a_file_system_mounted_over_the_log_is_found_at_the_next_append(job):
    _, _, records = trained(job, 12)
    shadow = started(job, records, 8)
    log = os.path.join(job.run_url, "log")
    mounted = False
    try:
        push(shadow, records[8:10])
        assert wait_until(lambda: shadow.status().durable_log_step == 9)
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "zocheck-remount", log],
                                  capture_output=True, text=True)
        except FileNotFoundError as exc:
            pytest.skip(f"a file system cannot be mounted here: {exc}")
        if done.returncode != 0:  # mounting needs CAP_SYS_ADMIN
            pytest.skip(f"a file system cannot be mounted here: {done.stderr.strip()}")
        mounted = True
        push(shadow, records[10:12])
        assert stopped(shadow).persist_error == (f"the durable step log lost steps 0..9: {log}/seg-000000000000.zlog "
                                                 "is gone; the run's storage changed under it")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", log], capture_output=True)
        shadow.close()


def test_a_snapshots_directory_replaced_under_the_shadow_is_found_before_the_next_commit(job):
    _, _, records = trained(job, 12)
    shadow = started(job, records, 8)
    kept = ", ".join(str(i.step) for i in reversed(SnapshotStore(job.run_url, create=False).committed()))
    try:
        snapshots = os.path.join(job.run_url, "snapshots")
        os.rename(snapshots, snapshots + ".old")
        os.mkdir(snapshots)
        push(shadow, records[8:12])  # the snapshot of step 12 is the next commit
        status = stopped(shadow)
        assert status.persist_stop_reason == "storage_lost"
        assert status.persist_error == (
            f"the committed snapshots (steps {kept}) are lost: {snapshots} names another directory than the one "
            "written (it or a directory above it was deleted or replaced, or a file system was mounted over it); "
            "the run's storage changed under it")
        assert os.listdir(snapshots) == []  # nothing committed into its stead
    finally:
        shadow.close()


def test_a_committed_snapshot_removed_under_the_shadow_is_named_at_the_next_commit(job):
    _, _, records = trained(job, 12)
    shadow = started(job, records, 8)
    try:
        os.remove(os.path.join(job.run_url, "snapshots", "step-000000000008", "model.safetensors"))
        push(shadow, records[8:12])
        status = stopped(shadow)
        assert status.persist_error == (
            f"the committed snapshot of step 8 is lost: {job.run_url}/snapshots/step-000000000008/model.safetensors "
            "is gone; the run's storage changed under it")
    finally:
        shadow.close()


# ------------------------------------------------------------------------------------ storage that refuses writes


def test_a_snapshots_directory_made_immutable_mid_run_stops_persistence_and_a_drain_says_so_at_once(job):
    _, _, records = trained(job, 12)
    shadow = started(job, records, 8)
    undo = immutable(os.path.join(job.run_url, "snapshots"))
    try:
        push(shadow, records[8:12])
        status = stopped(shadow)  # the snapshot of step 12 refused three times in a row
        assert status.persist_stop_reason == "storage_refused"
        assert status.persist_error.startswith(
            f"the run's storage refuses its writes: cannot create {job.run_url}/snapshots/step-000000000012: "
            "permission denied (")
        assert status.persist_error.endswith("check the path's permissions and attributes (chattr -i), or the "
                                             "credentials")
        assert status.durable_step == 8  # the snapshots before are still there
        with pytest.raises(StageError, match="the run's storage refuses its writes"):
            shadow.drain(12, timeout=600)  # not a wait of its timeout
    finally:
        undo()
        shadow.close()


def test_the_up_front_probe_writes_in_every_directory_of_the_run_not_only_its_root(job):
    from zocheck_ray.storage.errors import StorageRefusedError
    from zocheck_ray.storage.probe import check_writable

    _, _, records = trained(job, 8)
    started(job, records, 8).close()
    check_writable(job.run_url)
    undo = immutable(os.path.join(job.run_url, "snapshots"))
    try:
        with pytest.raises(StorageRefusedError, match=rf"^{re.escape(job.run_url)}/snapshots is not writable: "):
            check_writable(job.run_url)
        open_storage(job.run_url)  # its root still takes a write: the probe of the root alone passed
    finally:
        undo()


def test_a_resume_into_an_immutable_snapshots_directory_is_refused_before_ray_in_one_line(job, tmp_path, capsys):
    from zocheck_ray.cli import main

    _, _, records = trained(job, 8)
    started(job, records, 8).close()
    (tmp_path / "job.yaml").write_text(f"run_id: {job.run_id}\n")
    undo = immutable(os.path.join(job.run_url, "snapshots"))
    try:
        assert main(["train", "--config", str(tmp_path / "job.yaml"), "--storage", str(tmp_path)]) == 2  # no Ray
    finally:
        undo()
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.search(rf"cannot be used: {re.escape(job.run_url)}/snapshots is not writable: (Operation not permitted "
                     r"\(EPERM\)|Permission denied \(EACCES\)); check its permissions and attributes \(chattr -i\), "
                     "or the credentials$", err.strip()), err


# ------------------------------------------------------------------------------------ a full disk


class FakeRun:
    """What `Monitor.check` reads of the controller: the step, the lag bound, a stop signal, the warnings."""

    def __init__(self, step: int, max_lag_steps: int):
        self.step, self.max_lag_steps, self.warnings = step, max_lag_steps, []
        self.stop = StopRequest()

    def warn(self, message: str) -> None:
        self.warnings.append(message)


def progress(step: int) -> TrainerProgress:
    publisher = PublisherStats(held_records=0, resent_records=0, delivered_records=step, shadow_restarts_seen=0,
                               publish_errors=0, last_publish_error=None, gap=None)
    return TrainerProgress(step=step, loss=1.0, rank=0, publisher=publisher,
                           kernel=KernelInfo(device="cpu", backend="eager"), step_seconds=[0.01])


def test_a_full_disk_keeps_its_error_while_the_durable_snapshot_is_behind_and_the_run_stops_past_the_bound(
        small_disk):
    """Snapshots every 4 steps, durable every 8, the lag bound 8: a recovery from storage may replay 8 + 2 x 8 = 24
    steps. The disk fills after the snapshot of step 8: the log goes on (small appends fit), the snapshots of steps
    16, 24 and 32 do not, and between them images that are not due pass without a write; the error stays, so the
    monitor stops the run once the trainer is more than 24 steps past step 8."""
    job = JobConfig(storage=str(small_disk.path), shadow={"snapshot_interval": 4, "max_lag_steps": 8},
                    durability={"durable_interval": 8}, zo=dict(lr=1e-3, eps=1e-3))
    _, _, records = trained(job, 34)
    shadow = started(job, records, 8)
    try:
        small_disk.fill(leave=shadow.metrics().state_bytes // 2)
        push(shadow, records[8:34])
        assert wait_until(lambda: shadow.status().durable_log_step == 33)  # the log is written on
        assert shadow.replay.wait_replayed(34, timeout=120)  # the image of step 32 refused, the newest
        assert wait_until(lambda: shadow.persist.failures >= 3)
        status = shadow.status()
        assert "(ENOSPC)" in status.persist_error and status.durable_step == 8
        run = FakeRun(step=34, max_lag_steps=8)
        failure = Monitor(job).check(run, status, progress(34))
        assert (failure.kind, failure.step) == ("durability_stalled", 34)
        assert failure.detail == (
            f"the newest durable snapshot in {job.run_url}, of step 8, is 26 steps behind the trainer, more than a "
            f"recovery from storage may replay (24: the lag bound 8 + 2 x the durable interval 8); last storage "
            f"error: {status.persist_error}")
        with run.stop.installed():  # a stop asked for at this boundary: the run stops there, saying so
            os.kill(os.getpid(), signal.SIGTERM)
            assert wait_until(lambda: run.stop.requested)
            assert Monitor(job).check(run, status, progress(34)) is None
    finally:
        small_disk.free()
        shadow.close()


def test_a_drain_on_a_full_disk_whose_lease_lapsed_is_told_at_once_not_at_its_timeout(small_disk):
    """The disk is filled to its last block: neither a snapshot nor the lease's renewal fits, and the lease lapses.
    Taking it again fails for lack of space as any write does, so a drain (a stop's, the final one) ends after the
    failed writes that tell it the disk is full, not after its timeout."""
    from zocheck_ray.control.profile import DRAIN_SECONDS
    from zocheck_ray.runtime.persist import FULL_TRIES

    job = JobConfig(storage=str(small_disk.path), shadow={"snapshot_interval": 4}, durability={"lease_seconds": 2},
                    zo=dict(lr=1e-3, eps=1e-3))
    _, _, records = trained(job, 12)
    shadow = started(job, records, 8)
    try:
        small_disk.fill(leave=0)
        push(shadow, records[8:12])
        assert wait_until(lambda: "the run's lease lapsed" in (shadow.status().persist_error or ""))
        before = shadow.persist.failures
        with pytest.raises(StageError, match=r"^the image of step 12 and its log are not durable: storage is full "
                                             r"\(StorageFullError: cannot write .*\(ENOSPC\)"):
            shadow.drain(12, timeout=DRAIN_SECONDS)
        assert shadow.persist.failures - before <= FULL_TRIES  # the writes decided it, not the timeout
    finally:
        small_disk.free()
        shadow.close()


# ------------------------------------------------------------------------------------ verify


def test_verify_fails_where_the_log_a_manifest_promises_is_gone_and_names_the_steps_it_cannot_prove(job, capsys):
    from zocheck_ray.cli import main

    _, _, records = trained(job, 12)
    shadow = started(job, records, 8)
    push(shadow, records[8:12])
    shadow.drain(12, timeout=120)
    assert shadow.close()
    assert audit_run(job.run_url).verified
    shutil.rmtree(os.path.join(job.run_url, "log"))
    audit = audit_run(job.run_url)
    manifest = f"{job.run_url}/snapshots/step-000000000012/manifest.json"
    assert not audit.verified
    assert audit.mismatches == [f"the log that {manifest} promises, steps 8..11, is missing: steps 8..11 cannot "
                                "be proven"]
    assert main(["verify", job.run_url]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ("steps 12..12 proven, steps 8..11 NOT proven: 1 snapshot, 0 records, 1 mismatches: the log "
                       f"that {manifest} promises, steps 8..11, is missing: steps 8..11 cannot be proven")


def test_verify_fails_where_the_log_a_manifest_promises_is_cut_short_and_names_the_steps_it_cannot_prove(job):
    from zocheck_ray.storage.steplog.segments import SEGMENT_MAGIC

    _, _, records = trained(job, 12)
    shadow = started(job, records, 8)
    push(shadow, records[8:12])
    shadow.drain(12, timeout=120)
    assert shadow.close()
    segment = os.path.join(job.run_url, "log", "seg-000000000008.zlog")
    os.truncate(segment, len(SEGMENT_MAGIC) + len(records[8].to_bytes()) + len(records[9].to_bytes()))  # steps 8, 9
    audit = audit_run(job.run_url)
    manifest = f"{job.run_url}/snapshots/step-000000000012/manifest.json"
    assert not audit.verified and audit.unproven_steps == [(10, 11)]
    assert audit.mismatches == [f"the log that {manifest} promises, steps 8..11, ends at step 9: steps 10..11 cannot "
                                "be proven"]
