"""Recovered runs equal uninterrupted runs, bit for bit, on a real local Ray cluster.

The trainer process is killed at given steps; Ray restarts it and it recovers from
the shadow's in-memory image plus the records after it. Every step's `state_hash`
(including the steps recomputed after a failure) and the final state must equal a
plain, uninterrupted ZO loop over the same model, seeds and batches.
"""

import os

import pytest
import ray
import torch

from reference_runs import STEPS, assert_exact, job_for, uninterrupted_hashes
from zocheck_ray.config import JobConfigError, load_job_config
from zocheck_ray.testing import run_with_faults as run
from zocheck_ray.testing import FaultInjection


pytestmark = pytest.mark.usefixtures("local_ray")  # conftest: a Ray instance of the module's own


# Every optimizer, and each dtype, through Ray's restarts: the recovery path is the same for all of
# them (image + records replayed); the replay itself is proven exact for every optimizer x dtype
# x perturbation, without Ray, in test_core_exactness.py.
@pytest.mark.parametrize("dtype, optimizer", [("fp32", "zo-sgd"), ("bf16", "zo-adam"), ("bf16", "sparse-mezo")])
def test_three_software_failures_recover_exactly(tmp_path, optimizer, dtype):
    job = job_for(tmp_path, optimizer, dtype)
    summary = run(job, fail_at=[5, 17, 30], progress=None)
    assert [r.failed_at_step for r in summary.recoveries] == [5, 17, 30]
    assert all(r.image_source == "memory" for r in summary.recoveries)
    for r in summary.recoveries:
        assert r.recovered_step <= r.failed_at_step
        assert r.recovered_step == (r.image_step or 0) + r.replayed_records
        # where the time went: Ray's restart of the process (its constructor: a skeleton), then the restore
        assert r.replaced_by == "restart" and set(r.phases) == {"restart", "rejoin", "constructor", "restore", "install"}
        assert r.phases["restart"] + r.phases["rejoin"] == pytest.approx(r.seconds, abs=0.05)
        assert 0 < r.phases["install"] <= r.phases["restore"] <= r.phases["rejoin"]
    assert_exact(summary, uninterrupted_hashes(job))


@ray.remote(max_restarts=1)
class _RestartsSlowly:
    """Its restart waits in the constructor until `gate` exists: a restart that cannot finish by itself."""

    def __init__(self, gate: str):
        import time

        while ray.get_runtime_context().was_current_actor_reconstructed and not os.path.exists(gate):
            time.sleep(0.01)

    def ping(self) -> str:
        return "alive"


def test_waiting_for_a_restart_ends_when_the_actor_is_alive_again(tmp_path):
    import threading
    import time

    from zocheck_ray.actors.ray_actors import wait_until_alive

    gate = tmp_path / "gate"
    actor = _RestartsSlowly.remote(str(gate))
    assert ray.get(actor.ping.remote()) == "alive"
    ray.kill(actor, no_restart=False)
    from ray._private.state import actors
    while actors(actor_id=actor._actor_id.hex())["State"] != "RESTARTING":  # the GCS has seen the kill
        time.sleep(0.01)
    waiter = threading.Thread(target=wait_until_alive, args=(actor,))
    waiter.start()
    waiter.join(timeout=1.0)
    assert waiter.is_alive()  # the constructor cannot finish before the gate opens: still restarting
    gate.touch()
    waiter.join(timeout=120)
    assert not waiter.is_alive()
    assert ray.get(actor.ping.remote()) == "alive"
    ray.kill(actor)


def test_one_failure_before_the_first_snapshot(tmp_path):
    job = job_for(tmp_path, snapshot_interval=1000)
    summary = run(job, fail_at=[7], progress=None)
    (recovery,) = summary.recoveries
    assert recovery.image_step == 0  # the initial image
    assert_exact(summary, uninterrupted_hashes(job))


def test_losing_both_processes_recovers_from_durable_storage(tmp_path):
    job = job_for(tmp_path, optimizer="zo-adam")
    summary = run(job, fail_at=[21], fail_mode="host", progress=None)
    (recovery,) = summary.recoveries
    assert recovery.mode == "host" and recovery.image_source == "durable"
    assert_exact(summary, uninterrupted_hashes(job))


def test_a_failure_during_recovery_itself(tmp_path):
    job = job_for(tmp_path, optimizer="zo-adam")
    summary = run(job, fail_at=[13], progress=None,
                  faults=FaultInjection(crash_in_recovery_marker=str(tmp_path / "crashed")))
    assert (tmp_path / "crashed").exists()  # the first recovery attempt died
    (recovery,) = summary.recoveries
    assert recovery.failed_at_step == 13
    assert_exact(summary, uninterrupted_hashes(job))


def test_metrics_are_consistent_after_a_run(tmp_path):
    job = job_for(tmp_path, hash_every_step=False)
    summary = run(job, progress=None)
    m = summary.metrics
    assert m.run_id == job.run_id
    assert m.received_step == m.replayed_step == m.trainer_step == STEPS
    assert m.lag_steps == 0
    assert m.snapshot_interval == 8
    assert m.snapshot_step == STEPS
    assert m.durable_step == STEPS
    assert m.rejected_records == 0
    assert summary.publish_us_median is not None and summary.publish_us_median < 1000


def test_a_slow_shadow_is_resynced_and_recovery_stays_exact(tmp_path):
    # 1 s per replayed step, a one-row step and a poll every 12 steps: the shadow falls more than
    # 2 steps behind whenever a trainer step takes under ~0.8 s (a heavily loaded two-core machine included).
    job = job_for(tmp_path, max_lag_steps=2, log_interval=12,
                  task=dict(batch_size=1, max_length=16, eval_size=4, eval_interval=1000))
    summary = run(job, fail_at=[25], progress=None, faults=FaultInjection(replay_delay_seconds=1.0))
    assert summary.metrics.resync_count >= 1
    assert summary.resyncs and all("lags more than 2 steps" in why for _, why in summary.resyncs)
    assert summary.lag_samples and all(lag <= job.max_lag_steps for _, lag in summary.lag_samples)
    assert_exact(summary, uninterrupted_hashes(job))


def test_a_config_that_cannot_run_fails_before_any_actor(tmp_path):
    with pytest.raises(JobConfigError, match="shadow_cpus"):
        run(job_for(tmp_path, shadow_cpus=64), progress=None)
    if not torch.cuda.is_available():  # where there is a GPU, use_gpu="yes" is a valid job
        with pytest.raises(JobConfigError, match="use_gpu"):
            run(job_for(tmp_path, use_gpu="yes"), progress=None)
    with pytest.raises(JobConfigError, match="model"):
        load_job_config(overrides=["model=no-such-model"])
    with pytest.raises(ValueError, match="unsupported storage URL scheme 'ftp' in ftp://nowhere/runs"):
        job_for(tmp_path, storage="ftp://nowhere/runs")  # refused by the schema, before run() is reached
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(JobConfigError, match="storage="):
        run(job_for(tmp_path, storage=str(blocker)), progress=None)
    with pytest.raises(JobConfigError, match="fail_at step 3 falls in the startup profile"):
        run(job_for(tmp_path, snapshot_interval=None), fail_at=[3], progress=None)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True)]


def thread_niceness(pid: int) -> list[int]:
    """The nice value of every thread of process `pid` (field 19 of /proc/PID/task/TID/stat)."""
    values = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                values.append(int(f.read().rsplit(")", 1)[1].split()[16]))
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return values


def test_status_and_metrics_agree_during_a_run(tmp_path, capsys):
    import json
    import threading
    import time

    from zocheck_ray.actors.ray_actors import NAMESPACE, shadow_name, trainer_name
    from zocheck_ray.cli import main

    job = job_for(tmp_path, hash_every_step=False, max_lag_steps=1000)
    result = {}
    worker = threading.Thread(target=lambda: result.update(summary=run(
        job, progress=None, faults=FaultInjection(replay_delay_seconds=0.02))))
    worker.start()
    samples, niceness = [], {}
    while worker.is_alive() and len(samples) < 8:
        try:
            shadow = ray.get_actor(shadow_name(job.run_id), namespace=NAMESPACE)
        except ValueError:
            time.sleep(0.1)
            continue
        capsys.readouterr()
        if main(["status", job.run_id, "--json"]) != 0:
            time.sleep(0.1)
            continue
        reported = json.loads(capsys.readouterr().out)
        direct = ray.get(shadow.metrics.remote()).model_dump(mode="json")
        samples.append((reported, direct))
        if not niceness:  # every thread of the shadow yields the CPU to the trainer, whose own do not
            try:
                trainer = ray.get_actor(trainer_name(job.run_id), namespace=NAMESPACE)
            except ValueError:  # the shadow starts first
                continue
            niceness = {"shadow": thread_niceness(ray.get(shadow.pid.remote())),
                        "trainer": thread_niceness(ray.get(trainer.pid.remote()))}
        time.sleep(0.2)
    worker.join()
    assert len(samples) >= 3
    # (Ray runs actors' tasks at niceness 15, its own threads at 0)
    assert min(niceness["shadow"]) >= job.shadow_nice == 19 and max(niceness["trainer"]) == 15, niceness
    for reported, direct in samples:
        assert reported["run_id"] == direct["run_id"] == job.run_id
        for m in (reported, direct):
            assert m["lag_steps"] == m["trainer_step"] - m["replayed_step"] >= 0
            assert m["replayed_step"] <= m["received_step"] <= m["trainer_step"] <= STEPS
            assert m["snapshot_step"] is None or m["snapshot_step"] <= m["replayed_step"]
            assert m["snapshot_interval"] == 8
        for key in ("received_step", "replayed_step", "snapshots_taken"):
            assert reported[key] <= direct[key]  # status was read first; counters only grow
    assert result["summary"].steps == STEPS
