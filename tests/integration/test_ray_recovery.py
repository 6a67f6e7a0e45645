"""Recovered runs equal uninterrupted runs, bit for bit, on a real local Ray cluster.

The trainer process is killed at given steps; Ray restarts it and it recovers from
the shadow's in-memory image plus the records after it. Every step's `state_hash`
(including the steps recomputed after a failure) and the final state must equal a
plain, uninterrupted ZO loop over the same model, seeds and batches.
"""

import contextlib
import io
import os
import tempfile

import pytest
import ray
import torch

from reference_runs import SMALL_TASK, STEPS, assert_exact, job_for, uninterrupted_hashes
from support import wait_until
from zocheck_ray.config import JobConfigError, load_job_config
from zocheck_ray.control import RunCallback
from zocheck_ray.testing import run_with_faults as run
from zocheck_ray.runtime.injection import FaultInjection


# jobs on a real Ray instance with injected failures; local_ray: the local Ray instance
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]


# One cell through Ray's restarts: the recovery path (image + records replayed) is the same for every
# optimizer and dtype; every optimizer x {full, LoRA, prefix} x {fp32, bf16} takes three software failures
# and a host failure in process (the same Trainer and Shadow) in tests/unit/test_recovery_matrix.py, and
# the replay is proven exact for every optimizer x dtype x perturbation in test_core_exactness.py. ZO-Adam in
# bf16: the most state (two moments) and the dtype whose rounding the replay must repeat. fp32 ZO-SGD and
# Sparse-MeZO (its records carry thresholds) meet Ray's restarts in the other tests of this module.
@pytest.mark.ray_range
def test_three_software_failures_recover_exactly(tmp_path, monkeypatch):
    job = job_for(tmp_path, "zo-adam", "bf16")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    os.mkdir(tmp_path / "temp")
    summary = run(job, fail_at=[5, 17, 30], progress=None)
    # the injection's markers went with the run; torch's compile cache may stay (the first import of a transformers
    # model in this process makes it in the temporary directory)
    assert [name for name in os.listdir(tmp_path / "temp") if not name.startswith("torchinductor_")] == []
    assert [r.failed_at_step for r in summary.recoveries] == [5, 17, 30]
    assert all(r.image_source == "memory" for r in summary.recoveries)
    for r in summary.recoveries:
        assert r.recovered_step <= r.failed_at_step
        assert r.recovered_step == (r.image_step or 0) + r.replayed_records
        # where the time went: Ray's restart of the process (its constructor: a skeleton), then the restore
        assert r.replaced_by == "restart" and set(r.phases) == {"restart", "rejoin", "constructor", "restore", "waited",
                                                                  "fetch", "install", "copy", "replay", "hash"}
        assert r.phases["restart"] + r.phases["rejoin"] == pytest.approx(r.seconds, abs=0.05)
        assert 0 < r.phases["copy"] <= r.phases["install"] <= r.phases["restore"] <= r.phases["rejoin"]
        parts = ("fetch", "install", "replay", "hash")  # the restore's parts, as the process timed them
        assert sum(r.phases[p] for p in parts) == pytest.approx(r.phases["restore"], abs=1e-6)
        assert r.phases["restore"] + r.phases["waited"] <= r.phases["rejoin"] + 1e-6  # the rest: building, if any
        assert r.copy_threads >= 1  # the image's bytes into the state, on this many threads
        assert r.read_through == "memfd"  # opened on the shadow's node
    assert_exact(summary, uninterrupted_hashes(job))


def test_a_lora_adapter_with_momentum_and_two_perturbations_through_a_restart(tmp_path):
    """ZO-SGD-MMT on a LoRA adapter in bf16, two perturbations a step and micro-batches: a software failure
    (the restarted trainer builds the frozen base itself and takes the adapter from the image). Every optimizer
    x {full, LoRA, prefix} x dtype takes three software failures and a host failure (the shadow rebuilds the
    adapter from durable storage) in process in tests/unit/test_recovery_matrix.py; a host failure on Ray:
    test_ray_host_failure, test_ray_shadow_faults."""
    job = job_for(tmp_path, "zo-sgd-mmt", "bf16", peft={"method": "lora", "r": 2, "lora_alpha": 4},
                  zo=dict(optimizer="zo-sgd-mmt", lr=2e-3, eps=1e-2, num_perturbations=2),
                  task={**SMALL_TASK, "micro_batch_size": 2})
    summary = run(job, fail_at=[9], progress=None)
    assert [(r.failed_at_step, r.image_source) for r in summary.recoveries] == [(9, "memory")]
    assert_exact(summary, uninterrupted_hashes(job))


class Settled(RunCallback):
    """At each segment's end, waits until the shadow has replayed the segment's records (its replica is past the
    initial image) and the initial image is durable with no persist in flight: with no snapshot due before the
    failure, nothing pins the image's memory when the trainer asks for a snapshot."""

    def on_segment(self, run, segment):
        def settled():
            m = run.shadow.metrics()
            return m.replayed_step >= segment.progress.step and m.durable_step == 0 and not m.persist_in_flight

        assert wait_until(settled, timeout=180)


def test_a_failure_before_the_first_snapshot_and_during_recovery_itself(tmp_path):
    """Lost before the shadow's first snapshot, and the first recovery attempt dies too, with the image copied.
    The shadow catches its replica up and snapshots it for the recovering trainer (`shadow.recovery_snapshot`), which
    copies it and replays nothing. The path without (the initial image and every record since, the attempt
    dying with them not replayed): test_standby's promotion tests, which turn it off."""
    # records carry per-tensor thresholds
    job = job_for(tmp_path, optimizer="sparse-mezo", shadow={"snapshot_interval": 1000})
    summary = run(job, fail_at=[13], progress=None, callbacks=[Settled()],
                  faults=FaultInjection(crash_in_recovery_marker=str(tmp_path / "crashed")))
    assert (tmp_path / "crashed").exists()  # the first recovery attempt died
    (recovery,) = summary.recoveries
    assert recovery.failed_at_step == 13 and recovery.recovered_step > 0
    # taken once, for the first attempt: the second found the image at the replica's step
    assert recovery.image_step == recovery.recovered_step and recovery.replayed_records == 0
    assert summary.metrics.recovery_snapshots == 1
    assert_exact(summary, uninterrupted_hashes(job))


def test_a_shadow_that_cannot_keep_up_is_resynced_and_recovery_stays_exact_on_a_plain_host(tmp_path, monkeypatch):
    """On a host that offers none of the speed-ups (`ZOCHECK_HOST_PLAIN=1`, handed to the actors): the resyncs
    write the trainer's state and the recovery reads the image through Ray, not through a memfd."""
    monkeypatch.setenv("ZOCHECK_HOST_PLAIN", "1")
    # The shadow replays nothing by itself: at every poll (every 12 steps) it lags 12 steps, more than 2,
    # however fast or slow the trainer is; only the resyncs move its replica.
    job = job_for(tmp_path, shadow={"max_lag_steps": 2}, log_interval=12,
                  task=dict(batch_size=1, max_length=16, eval_size=4, eval_interval=1000))
    summary = run(job, fail_at=[25], progress=None, faults=FaultInjection(replay_stalled=True))
    assert summary.metrics.resync_count >= 1
    assert summary.resyncs and all("lags more than 2 steps" in why for _, why in summary.resyncs)
    assert summary.lag_samples and all(lag <= job.shadow.max_lag_steps for _, lag in summary.lag_samples)
    assert [r.read_through for r in summary.recoveries if r.copy_threads] == ["ray"]
    assert_exact(summary, uninterrupted_hashes(job))


def test_a_config_that_cannot_run_fails_before_any_actor(tmp_path):
    with pytest.raises(JobConfigError, match=r"shadow\.cpus=64 plus one trainer CPU exceed the largest node"):
        run(job_for(tmp_path, shadow={"cpus": 64}), progress=None)
    if not torch.cuda.is_available():  # where there is a GPU, use_gpu="yes" is a valid job
        with pytest.raises(JobConfigError, match=r"scaling\.use_gpu=yes but no node"):
            run(job_for(tmp_path, scaling={"use_gpu": "yes"}), progress=None)
    with pytest.raises(JobConfigError, match="model"):
        load_job_config(overrides=["model=no-such-model"])
    with pytest.raises(ValueError, match="unsupported storage URL scheme 'ftp' in ftp://nowhere/runs"):
        job_for(tmp_path, storage="ftp://nowhere/runs")  # refused by the schema, before run() is reached
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(JobConfigError, match="storage="):
        run(job_for(tmp_path, storage=str(blocker)), progress=None)
    with pytest.raises(JobConfigError, match="fail_at step 3 falls in the startup profile"):
        run(job_for(tmp_path, shadow={"snapshot_interval": None}), fail_at=[3], progress=None)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True)]


def threads_of(pid: int) -> list[tuple[str, int]]:
    """(name, nice value) of every thread of process `pid` (/proc/PID/task/TID/comm, field 19 of .../stat)."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                found.append((name, int(f.read().rsplit(")", 1)[1].split()[16])))
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return found


PIPELINE_THREADS = {"zocheck-replay", "zocheck-persist"}
"""The shadow's background threads; the workers they start carry their names."""


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory):
    """A run read at every segment boundary (the controller waits for `on_segment`, so the actors are
    alive and the reads happen however fast the machine is): `zocheck-ray status`, the shadow's metrics
    read directly, and the threads of the shadow and the trainer processes. Two shadow CPUs, so the
    replay starts a team of numba workers."""
    import json

    from zocheck_ray.actors.names import NAMESPACE, shadow_name, trainer_name
    from zocheck_ray.cli import main

    job = job_for(tmp_path_factory.mktemp("sampled"), hash_every_step=False,
                  shadow={"max_lag_steps": 1000, "cpus": 2})
    samples, threads = [], []

    def sample(progress, metrics):
        shadow = ray.get_actor(shadow_name(job.run_id), namespace=NAMESPACE)
        trainer = ray.get_actor(trainer_name(job.run_id), namespace=NAMESPACE)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(["status", job.run_id, "--json"]) == 0
        samples.append((json.loads(out.getvalue()), ray.get(shadow.metrics.remote()).model_dump(mode="json")))
        threads.append({"shadow": threads_of(ray.get(shadow.pid.remote())),
                        "trainer": threads_of(ray.get(trainer.pid.remote()))})

    summary = run(job, progress=None, on_segment=sample, faults=FaultInjection(replay_delay_seconds=0.02))
    return {"job": job, "summary": summary, "samples": samples, "threads": threads}


def test_status_and_metrics_agree_during_a_run(sampled_run):
    job, samples = sampled_run["job"], sampled_run["samples"]
    assert len(samples) == STEPS // job.log_interval  # one per segment
    for reported, direct in samples:
        assert reported["run_id"] == direct["run_id"] == job.run_id
        for m in (reported, direct):
            assert m["lag_steps"] == m["trainer_step"] - m["replayed_step"] >= 0
            assert m["replayed_step"] <= m["received_step"] <= m["trainer_step"] <= STEPS
            assert m["snapshot_step"] is None or m["snapshot_step"] <= m["replayed_step"]
            assert m["snapshot_interval"] == 8
        for key in ("received_step", "replayed_step", "snapshots_taken"):
            assert reported[key] <= direct[key]  # status was read first; counters only grow
    # the newest held-out evaluation (every eval_interval = 10 steps, and at the last) as status shows it
    assert [reported["held_out_step"] for reported, _ in samples] == [0, 10, 10, 20, 30, STEPS]
    evaluations = sampled_run["summary"].evaluations
    for reported, _ in samples:
        assert reported["held_out"] == pytest.approx(evaluations[reported["held_out_step"]])
        assert set(reported["held_out"]) == {"accuracy", "loss"}
    assert sampled_run["summary"].steps == STEPS


def test_metrics_are_consistent_after_a_run(sampled_run):
    job, summary = sampled_run["job"], sampled_run["summary"]
    m = summary.metrics
    assert m.run_id == job.run_id
    assert m.received_step == m.replayed_step == m.trainer_step == STEPS
    assert m.lag_steps == 0
    assert m.snapshot_interval == 8
    assert m.snapshot_step == STEPS
    assert m.durable_step == STEPS
    assert m.rejected_records == 0
    assert summary.publish_us_median is not None and summary.publish_us_median > 0


def test_only_the_shadows_pipeline_runs_at_shadow_nice(sampled_run):
    """Replay and persistence (and the workers they start) yield the CPU to the trainer; the threads that
    answer `metrics()` and take in pushes keep Ray's niceness (15 for an actor's methods, 0 for Ray's own)."""
    nice = sampled_run["job"].shadow.nice
    assert nice == 19
    for seen in sampled_run["threads"]:
        trainer = {n for _, n in seen["trainer"]}
        assert max(trainer) == 15 and nice not in trainer, seen["trainer"]
        pipeline = [(name, n) for name, n in seen["shadow"] if name in PIPELINE_THREADS]
        others = [(name, n) for name, n in seen["shadow"] if name not in PIPELINE_THREADS]
        assert {name for name, _ in pipeline} == PIPELINE_THREADS, seen["shadow"]
        assert all(n == nice for _, n in pipeline), pipeline
        assert others and {n for _, n in others} <= trainer, others  # what Ray gives any actor's process
    # the replay's numba team: workers started by the replay thread, named and niced like it
    assert max(sum(name == "zocheck-replay" for name, _ in seen["shadow"]) for seen in sampled_run["threads"]) >= 2


@ray.remote
class _Unanswering:
    """Named as a run's shadow; its `metrics` never returns (a shadow whose methods cannot run)."""

    def metrics(self, trainers=None) -> dict:
        import threading

        threading.Event().wait()

    def ready(self) -> bool:
        return True

    def pid(self) -> int:  # queued behind the stuck `metrics`, as a real shadow's would be
        return 0


@pytest.mark.ray_range
def test_status_of_a_shadow_that_does_not_answer_ends_with_one_line(capsys):
    from zocheck_ray.actors.names import NAMESPACE, shadow_name
    from zocheck_ray.cli import main

    stuck = _Unanswering.options(name=shadow_name("stuck"), namespace=NAMESPACE).remote()
    assert ray.get(stuck.ready.remote())
    try:
        capsys.readouterr()
        assert main(["status", "stuck", "--timeout", "1"]) == 1
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1, err
        # (the local instance runs without the dashboard: the actor is asked itself, and does not answer either)
        assert err.startswith("zocheck-ray status: the shadow of run 'stuck' (actor zocheck-shadow-stuck) did not "
                              "answer within 1 s; Ray reports it not answering within 2 s"), err
    finally:
        ray.kill(stuck)
