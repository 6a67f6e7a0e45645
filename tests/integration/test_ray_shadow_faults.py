"""Faults nobody scripts, on a real local Ray cluster: the shadow process killed mid-run, the S3
endpoint stopped and restarted, paused, or gone for good, a trainer and then the shadow lost while
durability lags, a full disk. Each run ends exact (shadow == trainer,
a durable image at the last step) or with a clear error; none hangs, none passes silently.
"""

import re
import time

import pytest
import ray

from reference_runs import STEPS, assert_exact, job_for, uninterrupted_hashes
from support import PausableS3, wait_until
from zocheck_ray.actors.names import NAMESPACE, shadow_name
from zocheck_ray.control import RunCallback, RunFailedError
from zocheck_ray.testing import run_with_faults as run
from zocheck_ray.storage import SnapshotStore, read_log


# jobs with a killed shadow and S3 outages, then verified; local_ray: the local Ray instance
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]


def shadow_metrics(job):
    return ray.get(ray.get_actor(shadow_name(job.run_id), namespace=NAMESPACE).metrics.remote())


def assert_durable_and_whole(job, summary):
    """A durable image at the last step, and the log from the oldest retained snapshot on is whole."""
    assert summary.metrics.durable_step == STEPS and summary.metrics.durable_log_step == STEPS - 1
    oldest = SnapshotStore(job.run_url, job.storage_options, create=False).committed()[-1].step
    records = read_log(job.run_url, after_step=oldest - 1, storage_options=job.storage_options)
    assert [r.step for r in records] == list(range(oldest, STEPS))


def test_a_killed_shadow_comes_back_from_storage_and_the_trainer_fills_it_in(tmp_path):
    """On local storage; on S3, with the log then verified: test_verify_proves_the_run_...[s3-shadow]."""
    job = job_for(tmp_path)
    summary = run(job, fail_at=[20], fail_mode="shadow", progress=None)
    assert summary.shadow_restarts == 1 and not summary.recoveries
    assert any("the shadow restarted" in w for w in summary.warnings)
    assert_exact(summary, uninterrupted_hashes(job))


def test_an_s3_endpoint_stopped_and_restarted_mid_run_ends_durable_and_exact(tmp_path, private_s3):
    job = job_for(tmp_path, storage=f"s3://{private_s3.new_bucket()}/runs", storage_options=private_s3.options(),
                  durability={"log_seal_records": 4})
    events = []

    def outage(progress, metrics):
        if not events and progress.step >= 12:
            private_s3.stop()
            events.append("stopped")
        elif events == ["stopped"]:  # the next segment's check will see the failing store
            assert wait_until(lambda: shadow_metrics(job).persist_failures > 0, timeout=180)
            events.append("failing")
        elif events == ["stopped", "failing"]:
            private_s3.start()
            events.append("restarted")

    lines = []
    summary = run(job, progress=lines.append, on_segment=outage)
    assert events == ["stopped", "failing", "restarted"]
    assert any("durability is behind" in w for w in summary.warnings)
    assert any("durability is behind" in line for line in lines)
    assert summary.metrics.persist_failures > 0 and summary.metrics.persist_error is None
    assert_exact(summary, uninterrupted_hashes(job))


def test_a_paused_s3_endpoint_never_holds_up_ingest_and_durability_catches_up(tmp_path, aws_env):
    server = PausableS3()
    try:
        job = job_for(tmp_path, storage=f"s3://{server.new_bucket()}/runs", storage_options=server.options(),
                      durability={"log_seal_records": 4})
        seen = {}

        def pause(progress, metrics):
            if "paused_at" not in seen and progress.step >= 12:
                server.pause()
                seen["paused_at"] = progress.step
            elif "paused_at" in seen and "resumed" not in seen and progress.step >= seen["paused_at"] + 12:
                # The shadow keeps receiving while storage hangs: the segment's last push (sent as the
                # segment ended, beside this metrics call) arrives with storage still paused.
                shadow = ray.get_actor(shadow_name(job.run_id), namespace=NAMESPACE)
                assert wait_until(lambda: ray.get(shadow.metrics.remote()).received_step >= progress.step,
                                  timeout=180)
                latest = ray.get(shadow.metrics.remote())
                seen["received"] = latest.received_step
                seen["undurable"] = latest.undurable_steps
                server.resume()
                seen["resumed"] = True

        summary = run(job, progress=None, on_segment=pause)
        assert seen["resumed"]
        assert seen["received"] == seen["paused_at"] + 12
        assert seen["undurable"] > 0
        assert_exact(summary, uninterrupted_hashes(job))
        assert_durable_and_whole(job, summary)
    finally:
        server.close()


def test_storage_gone_for_good_fails_the_run_with_a_clear_error(tmp_path, private_s3):
    job = job_for(tmp_path, storage=f"s3://{private_s3.new_bucket()}/runs", storage_options=private_s3.options(),
                  durability={"max_undurable_steps": 8, "log_seal_records": 4}, hash_every_step=False)

    stopped = []

    def outage(progress, metrics):
        if not stopped and progress.step >= 6:
            private_s3.stop()
            stopped.append(progress.step)
        elif stopped:  # the records since then made a segment to upload: its upload has failed
            assert wait_until(lambda: shadow_metrics(job).persist_failures > 0, timeout=180)

    # the store's own error, not the open segment (4 records on S3 by design) counted as behind
    with pytest.raises(RunFailedError, match=r"not durable in s3://.*last storage error: (?!none)"
                                             r".*durability\.max_undurable_steps=8"):
        run(job, progress=None, on_segment=outage)
    assert not ray.util.list_named_actors(all_namespaces=True)  # nothing left running


@pytest.mark.parametrize("storage, fail_mode", [("local", "host"), ("s3", "shadow")])
def test_verify_proves_the_run_after_a_failure_and_collected_log_segments(tmp_path, storage, fail_mode, request):
    from zocheck_ray.cli import main
    from zocheck_ray.verify import verify_run

    root, options = (str(tmp_path), {}) if storage == "local" else request.getfixturevalue("s3_bucket")
    # the host failure in ZO-Adam: the shadow rebuilds both moments from durable storage
    optimizer = "zo-adam" if fail_mode == "host" else "zo-sgd"
    job = job_for(tmp_path, optimizer, storage=root, storage_options=options,
                  durability={"log_seal_records": 4})
    summary = run(job, fail_at=[21], fail_mode=fail_mode, progress=None)
    if fail_mode == "host":  # both processes lost: the pair comes back from durable storage
        (recovery,) = summary.recoveries
        assert recovery.mode == "host" and recovery.image_source == "durable"
    else:  # the shadow alone, on S3 (its local twin: test_a_killed_shadow_comes_back_...)
        assert summary.shadow_restarts == 1 and not summary.recoveries
        assert any("the shadow restarted" in w for w in summary.warnings)
    assert_exact(summary, uninterrupted_hashes(job))
    result = verify_run(job, summary)
    assert result.verified, result.mismatches
    assert not result.from_initial_state          # retention collected the log below the oldest snapshot
    assert 0 < result.proven_from_step < STEPS and result.proven_to_step == STEPS
    assert result.steps_checked >= STEPS - result.proven_from_step
    argv = ["verify", job.run_url] + (["--endpoint-url", options["endpoint_url"]] if options else [])
    assert main(argv) == 0                         # the same proof from the storage alone


def gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie not yet reaped by its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


class TrainerThenShadow(RunCallback):
    """A host failure in two steps while durability lags. At each of `pause_at` the S3 endpoint is paused:
    nothing written after it becomes durable, and once the shadow holds an image its storage does not (at
    the next segment's end) the trainer dies (`fail_at`) and recovers from it, holding the records after it
    only. At the end of the next segment the shadow is killed and the endpoint goes on once its process is
    gone: the restarted shadow comes back from the durable state, without records that no process holds
    any more. `and_wait`: wait there until the trainer sees it, so that the next segment's check meets it."""

    def __init__(self, server: PausableS3, pause_at: list[int], and_wait: list[bool]):
        self.server, self.pause_at, self.and_wait = server, list(pause_at), list(and_wait)
        self.paused = self.trainer_recovered = False
        self.shadow_killed_at: list[int] = []
        self.recoveries = []

    def on_segment(self, run, segment):
        if not self.paused and self.pause_at and segment.progress.step >= self.pause_at[0]:
            self.pause_at.pop(0)
            # Paused from a settled state: every snapshot up to this step taken and durable, none in flight
            # (a save the pause caught half-way would hold the image and defer the next snapshot).
            step = segment.progress.step
            assert wait_until(lambda: self.settled(run, step), timeout=180), run.shadow.metrics()
            self.server.pause()
            self.paused = True
        elif self.paused and not self.trainer_recovered:
            assert wait_until(lambda: self.image_not_durable(run), timeout=180), (
                f"at step {segment.progress.step} the shadow's image stays durable: "
                f"{run.shadow.metrics()}; recoveries so far: {self.recoveries}")
        elif self.paused:
            pid = run.shadow.pid()
            run.shadow.kill()  # Ray restarts it from durable storage
            assert wait_until(lambda: gone(pid), timeout=120)
            self.server.resume()
            self.paused = self.trainer_recovered = False
            self.shadow_killed_at.append(segment.progress.step)
            if self.and_wait.pop(0):
                assert wait_until(lambda: ray.get(run.group.leader.publisher_stats.remote()).gap, timeout=180)

    @staticmethod
    def settled(run, step: int) -> bool:
        m = run.shadow.metrics()
        return m.replayed_step == step and m.durable_step == m.snapshot_step and not m.persist_in_flight

    @staticmethod
    def image_not_durable(run) -> bool:
        m = run.shadow.metrics()
        return m.snapshot_step is not None and m.snapshot_step > (m.durable_step if m.durable_step is not None else -1)

    def on_recovery(self, run, recovery):
        self.recoveries.append(recovery)
        self.trainer_recovered = self.paused and recovery.cause == "trainer_lost"


def test_a_trainer_then_a_shadow_lost_while_durability_lags_recover_from_the_durable_state(tmp_path, aws_env):
    server = PausableS3()
    try:
        # No log segment is sealed (uploaded) but by a drain: the durable state is the last durable snapshot.
        job = job_for(tmp_path, storage=f"s3://{server.new_bucket()}/runs", storage_options=server.options(),
                      durability={"log_seal_records": 1000, "lease_seconds": 300})  # no pause outlasts the lease
        # Mid-run: paused at 12, the trainer dies at 19, the shadow at 24; the next check finds the records
        # lost. At the end: paused at 18 (the steps trained again), the trainer dies at 31, the shadow after
        # the last segment (36); the final drain finds the records lost.
        faults = TrainerThenShadow(server, pause_at=[12, 18], and_wait=[True, False])
        lines = []
        summary = run(job, fail_at=[19, 31], progress=lines.append, callbacks=[faults])
        assert_durable_and_whole(job, summary)
    finally:
        server.close()
    assert faults.shadow_killed_at == [24, STEPS]
    causes = [(r.cause, r.failed_at_step) for r in faults.recoveries]
    assert causes == [("trainer_lost", 19), ("records_lost", 30), ("trainer_lost", 31), ("records_lost", STEPS)]
    # each restored the trainer from the durable image, before the steps that were not durable
    lost = faults.recoveries[1::2]
    assert [r.image_source for r in lost] == ["durable", "durable"]
    assert lost[0].recovered_step < 19 and lost[1].recovered_step < 31
    said = [line for line in lines if "(a host failure in two steps)" in line]
    assert len(said) == 2, lines  # one line each
    assert summary.shadow_restarts == 2
    assert_exact(summary, uninterrupted_hashes(job))


class FillTheDisk(RunCallback):
    """At `fill_at` the run's disk is filled but for less than a snapshot needs; at the next segment's end,
    what the shadow says is taken once it reports the full disk (`seen`); a segment later the space is
    given back."""

    def __init__(self, disk, fill_at: int):
        self.disk, self.fill_at = disk, fill_at
        self.filled_unix: float | None = None
        self.seen = None
        self.freed = False

    def on_segment(self, run, segment):
        if self.filled_unix is None and segment.progress.step >= self.fill_at:
            self.lease_before = lease_of(run.job)
            self.disk.fill(leave=run.shadow.metrics().state_bytes // 2)
            self.filled_unix = time.time()
        elif self.filled_unix is not None and self.seen is None:
            step = segment.progress.step
            # The snapshot of step 16 does not fit; the log goes on; the lease is renewed all along.
            assert wait_until(lambda: self.full_and_logging(run, step), timeout=180)
        elif self.seen is not None and not self.freed:
            self.disk.free()
            self.freed = True

    def full_and_logging(self, run, step: int) -> bool:
        m = run.shadow.metrics()
        lease = lease_of(run.job)
        if "(ENOSPC)" in (m.persist_error or "") and m.durable_log_step == step - 1 \
                and lease.heartbeat_unix > self.filled_unix + run.job.durability.lease_seconds:
            self.seen = (m, lease)
        return self.seen is not None


def lease_of(job):
    from zocheck_ray.storage import read_lease
    from zocheck_ray.storage.fs import open_storage

    return read_lease(open_storage(job.run_url, create=False))


def test_a_full_disk_is_reported_as_such_keeps_the_log_and_the_lease_and_the_run_ends_exact(small_disk, tmp_path):
    job = job_for(tmp_path, storage=str(small_disk.path / "runs"), durability={"lease_seconds": 6})
    disk = FillTheDisk(small_disk, fill_at=12)
    lines = []
    summary = run(job, progress=lines.append, callbacks=[disk])
    assert disk.freed
    metrics, lease = disk.seen
    # the storage's own error, with the path of what did not fit: no lost lease
    assert re.fullmatch(rf"StorageFullError: cannot \w+ {re.escape(job.run_url)}/snapshots/step-\d{{12}}/\S+: No space "
                        r"left on device \(ENOSPC\); free space there, or give the run a larger storage",
                        metrics.persist_error)
    assert metrics.durable_step < 16 and not metrics.persist_stopped
    assert (lease.generation, lease.owner, lease.released) == (disk.lease_before.generation, disk.lease_before.owner,
                                                               False)
    assert any("durability is behind" in line and "(ENOSPC)" in line for line in lines), lines
    assert summary.metrics.persist_error is None
    assert_exact(summary, uninterrupted_hashes(job))
    assert_durable_and_whole(job, summary)
