"""Faults nobody scripts, on a real local Ray cluster: the shadow process killed mid-run, the S3
endpoint stopped and restarted, paused, or gone for good. Each run ends exact (shadow == trainer,
a durable image at the last step) or with a clear error; none hangs, none passes silently.
"""

import os
import signal
import subprocess
import sys

import pytest
import ray

from conftest import free_port
from reference_runs import STEPS, assert_exact, job_for, uninterrupted_hashes
from support import wait_until
from zocheck_ray.actors.ray_actors import NAMESPACE, shadow_name
from zocheck_ray.control import RunFailedError
from zocheck_ray.testing import run_with_faults as run
from zocheck_ray.storage import SnapshotStore, read_log

pytestmark = pytest.mark.slow  # jobs with a killed shadow and S3 outages, then verified


pytestmark = pytest.mark.usefixtures("local_ray")  # conftest: a Ray instance of the module's own


def shadow_metrics(job):
    return ray.get(ray.get_actor(shadow_name(job.run_id), namespace=NAMESPACE).metrics.remote())


def assert_durable_and_whole(job, summary):
    """A durable image at the last step, and the log from the oldest retained snapshot on is whole."""
    assert summary.metrics.durable_step == STEPS and summary.metrics.durable_log_step == STEPS - 1
    oldest = SnapshotStore(job.run_url, job.storage_options, create=False).committed()[-1].step
    records = read_log(job.run_url, after_step=oldest - 1, storage_options=job.storage_options)
    assert [r.step for r in records] == list(range(oldest, STEPS))


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_a_killed_shadow_comes_back_from_storage_and_the_trainer_fills_it_in(tmp_path, storage, request):
    root, options = (str(tmp_path), {}) if storage == "local" else request.getfixturevalue("s3_bucket")
    job = job_for(tmp_path, storage=root, storage_options=options)
    summary = run(job, fail_at=[20], fail_mode="shadow", progress=None)
    assert summary.shadow_restarts == 1 and not summary.recoveries
    assert any("the shadow restarted" in w for w in summary.warnings)
    assert_exact(summary, uninterrupted_hashes(job))
    assert_durable_and_whole(job, summary)


def test_an_s3_endpoint_stopped_and_restarted_mid_run_ends_durable_and_exact(tmp_path, private_s3):
    job = job_for(tmp_path, storage=f"s3://{private_s3.new_bucket()}/runs", storage_options=private_s3.options(),
                  log_seal_records=4)
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
    assert_durable_and_whole(job, summary)


class PausableS3:
    """A moto S3 server in a process of its own, so SIGSTOP pauses it: connections are accepted, never answered."""

    def __init__(self):
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"),
                                         "-H", "127.0.0.1", "-p", str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def options(self) -> dict:
        return {"endpoint_url": self.endpoint_url, "key": "testing", "secret": "testing",
                "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 2,
                                  "read_timeout": 5}}

    def new_bucket(self) -> str:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.options())
        assert wait_until(lambda: _answers(fs), timeout=60)
        fs.mkdir("zocheck-paused")
        return "zocheck-paused"

    def close(self):
        self.process.send_signal(signal.SIGCONT)
        self.process.kill()
        self.process.wait()


def _answers(fs) -> bool:
    try:
        fs.ls("")
        return True
    except Exception:
        return False


def test_a_paused_s3_endpoint_never_holds_up_ingest_and_durability_catches_up(tmp_path, aws_env):
    server = PausableS3()
    try:
        job = job_for(tmp_path, storage=f"s3://{server.new_bucket()}/runs", storage_options=server.options(),
                      log_seal_records=4)
        seen = {}

        def pause(progress, metrics):
            if "paused_at" not in seen and progress.step >= 12:
                server.process.send_signal(signal.SIGSTOP)
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
                server.process.send_signal(signal.SIGCONT)
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
                  max_undurable_steps=8, log_seal_records=4, hash_every_step=False)

    stopped = []

    def outage(progress, metrics):
        if not stopped and progress.step >= 6:
            private_s3.stop()
            stopped.append(progress.step)
        elif stopped:  # the records since then made a segment to upload: its upload has failed
            assert wait_until(lambda: shadow_metrics(job).persist_failures > 0, timeout=180)

    # the store's own error, not the open segment (4 records on S3 by design) counted as behind
    with pytest.raises(RunFailedError, match=r"not durable in s3://.*last storage error: (?!none).*max_undurable_steps=8"):
        run(job, progress=None, on_segment=outage)
    assert not ray.util.list_named_actors(all_namespaces=True)  # nothing left running


@pytest.mark.parametrize("storage, fail_mode", [("local", "host"), ("s3", "shadow")])
def test_verify_proves_the_run_after_a_failure_and_collected_log_segments(tmp_path, storage, fail_mode, request):
    from zocheck_ray.cli import main
    from zocheck_ray.verify import verify_run

    root, options = (str(tmp_path), {}) if storage == "local" else request.getfixturevalue("s3_bucket")
    job = job_for(tmp_path, storage=root, storage_options=options, log_seal_records=4)
    summary = run(job, fail_at=[21], fail_mode=fail_mode, progress=None)
    assert_exact(summary, uninterrupted_hashes(job))
    result = verify_run(job, summary)
    assert result.verified, result.mismatches
    assert not result.from_initial_state          # retention collected the log below the oldest snapshot
    assert 0 < result.proven_from_step < STEPS and result.proven_to_step == STEPS
    assert result.steps_checked >= STEPS - result.proven_from_step
    argv = ["verify", job.run_url] + (["--endpoint-url", options["endpoint_url"]] if options else [])
    assert main(argv) == 0                         # the same proof from the storage alone
