"""Storage that changes under a run or cannot take its writes, end to end: on a real local Ray, a log deleted
mid-run fails the run in one line naming the path and the steps lost; a SIGTERM under a full disk stops at the
next step boundary in one line, exit 143, without waiting out the drain. On a real S3 endpoint, the bucket
deleted under the shadow is found at its next commit. The same cases in process, with real files:
tests/unit/test_storage_durability.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time

import pytest
import ray

from reference_runs import job_for
from support import trained, wait_until
from zocheck_ray.control import RunCallback, RunFailedError
from zocheck_ray.control.profile import DRAIN_SECONDS
from zocheck_ray.control.stop import RunStopped
from zocheck_ray.runtime.errors import StageError
from zocheck_ray.testing import run_with_faults as run

pytestmark = pytest.mark.slow


class DeleteTheLog(RunCallback):
    """At the first segment's end at or after `step`, once the shadow's log holds a record of its own segment, the
    run's log/ is deleted."""

    def __init__(self, step: int):
        self.step = step
        self.deleted_at: int | None = None

    def on_segment(self, run, segment):
        if self.deleted_at is None and segment.progress.step >= self.step:
            assert wait_until(lambda: run.shadow.metrics().durable_log_step == segment.progress.step - 1)
            shutil.rmtree(os.path.join(run.job.run_url, "log"))
            self.deleted_at = segment.progress.step


@pytest.mark.usefixtures("local_ray")
def test_a_log_deleted_mid_run_fails_the_run_in_one_line_naming_the_path_and_the_steps_lost(tmp_path):
    job = job_for(tmp_path, hash_every_step=False)
    deleted = DeleteTheLog(step=12)
    lines = []
    with pytest.raises(RunFailedError) as failed:
        run(job, progress=lines.append, callbacks=[deleted])
    message = str(failed.value)
    assert "\n" not in message
    assert re.fullmatch(
        rf"run {job.run_id} failed at step \d+: the durable step log lost steps \d+\.\.{deleted.deleted_at - 1}: "
        rf"{re.escape(job.run_url)}/log/seg-\d{{12}}\.(zlog|open) is gone; the run's storage changed under it: the "
        r"run stops rather than write on and report durable what a recovery could not read; run the same job again "
        rf"to resume from what is left in {re.escape(job.run_url)} \(the trainer recomputes the steps lost\), or "
        r"restore it first", message), message
    assert [line for line in lines if "FAILED" in line] == [f"  FAILED: {message.split(': ', 1)[1]}"]
    assert not os.path.exists(os.path.join(job.run_url, "log"))  # not made again behind the loss
    assert not ray.util.list_named_actors(all_namespaces=True)  # nothing left running


class StopWhenFull(RunCallback):
    """At the first segment's end at or after `fill_at` the run's disk is filled to its last block; once the shadow
    reports it, a SIGTERM arrives."""

    def __init__(self, disk, fill_at: int):
        self.disk, self.fill_at = disk, fill_at
        self.signalled_at: int | None = None

    def on_segment(self, run, segment):
        if self.signalled_at is None and segment.progress.step >= self.fill_at:
            self.disk.fill(leave=0)
            assert wait_until(lambda: "(ENOSPC)" in (run.shadow.metrics().persist_error or ""))
            os.kill(os.getpid(), signal.SIGTERM)  # this process is the driver: its handler notes the stop
            assert wait_until(lambda: run.stop.requested)
            self.signalled_at, self.signalled_monotonic = segment.progress.step, time.monotonic()


@pytest.mark.usefixtures("local_ray")
def test_a_sigterm_under_a_full_disk_stops_at_the_next_step_boundary_in_one_line(small_disk, tmp_path):
    job = job_for(tmp_path, storage=str(small_disk.path / "runs"), hash_every_step=False)
    stop = StopWhenFull(small_disk, fill_at=12)
    lines = []
    try:
        with pytest.raises(RunStopped) as stopped:
            run(job, progress=lines.append, callbacks=[stop])
        ended = time.monotonic()
    finally:
        small_disk.free()
    assert ended - stop.signalled_monotonic < DRAIN_SECONDS  # decided by the failed writes, not the drain's timeout
    assert stopped.value.code == 143
    message = str(stopped.value)
    step = stop.signalled_at
    assert re.fullmatch(
        rf"stopped by SIGTERM at step {step}: the state there could not be made durable \(.*the image of step {step} "
        rf"and its log are not durable: storage is full \(StorageFullError: cannot \w+ {re.escape(job.run_url)}/\S+: "
        r"No space left on device \(ENOSPC\); free space there, or give the run a larger storage"
        r"( \(meanwhile the run's lease lapsed: [^()]*\([^()]*\): not renewed for [\d.]+ s\))?\)\); the durable "
        rf"state of step \d+ in {re.escape(job.run_url)} resumes the run(; the run's lease is released)?; run the "
        r"same job again to resume it", message), message
    assert lines[-1] == f"  {message}"
    assert not ray.util.list_named_actors(all_namespaces=True)


def test_a_bucket_deleted_under_the_shadow_is_found_at_its_next_commit(s3_bucket):
    import s3fs

    from zocheck_ray.config import JobConfig
    from zocheck_ray.runtime.shadow import Shadow

    url, options = s3_bucket
    job = JobConfig(storage=url, storage_options=options, shadow={"snapshot_interval": 4},
                    durability={"log_seal_records": 4}, zo=dict(lr=1e-3, eps=1e-3))
    initial, _, records = trained(job, 12)
    shadow = Shadow(job)
    try:
        shadow.initialize(0, initial)
        shadow.push(b"".join(r.to_bytes() for r in records[:8]))
        shadow.drain(8, timeout=120)
        s3fs.S3FileSystem(skip_instance_cache=True, **options).rm(url.removeprefix("s3://").split("/")[0],
                                                                   recursive=True)  # the bucket, and all in it
        shadow.push(b"".join(r.to_bytes() for r in records[8:]))
        assert wait_until(lambda: shadow.status().persist_stopped)
        status = shadow.status()
        assert status.persist_stop_reason == "storage_lost"
        assert re.fullmatch(rf"the (durable step log lost steps 0\.\.7|committed snapshot of step \d+ is lost): "
                            rf"{re.escape(job.run_url)}/\S+ is gone; the run's storage changed under it",
                            status.persist_error), status.persist_error
        with pytest.raises(StageError, match="is gone; the run's storage changed under it"):
            shadow.drain(12, timeout=600)
    finally:
        shadow.close()
