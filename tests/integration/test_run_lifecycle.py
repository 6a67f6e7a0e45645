"""How a run ends and starts again, on a real local Ray: a run that ended (finished or failed) has
released its lease, a finished run is extended or re-run with the same steps and says what is true,
and a second job with a running job's run id is refused before any actor starts.
"""

import pytest
import ray

from reference_runs import SMALL_TASK, assert_exact, job_for, uninterrupted_hashes
from zocheck_ray.actors.names import NAMESPACE, shadow_name
from zocheck_ray.actors.trainer_actor import TrainerActor
from zocheck_ray.config import JobConfig, JobConfigError
from zocheck_ray.control import RunFailedError
from zocheck_ray.control.placement import Placement
from zocheck_ray.control.startup import Startup
from zocheck_ray.control.profile import profile_steps
from zocheck_ray.storage import SnapshotStore, read_lease
from zocheck_ray.storage.fs import open_storage
from zocheck_ray.testing import run_with_faults as run
from zocheck_ray.runtime.injection import FaultInjection
from zocheck_ray.workload.errors import WorkloadError
from zocheck_ray.train_cli import result_table

pytestmark = pytest.mark.usefixtures("local_ray")  # conftest: the local Ray instance (slow)


def lease_of(job):
    return read_lease(open_storage(job.run_url, create=False))


def profiled_job(tmp_path, steps: int) -> JobConfig:
    """A job whose snapshot interval the startup profile chooses (run_id fixed: it is run again)."""
    return JobConfig.model_validate(dict(run_id="lifecycle", steps=steps, storage=str(tmp_path), log_interval=5,
                                         hash_every_step=True, zo=dict(lr=2e-3, eps=1e-3), task=SMALL_TASK))


def test_a_failed_run_has_released_its_lease(tmp_path, capfd):
    job = job_for(tmp_path, steps=12, failure={"max_restarts": 0})
    with pytest.raises(RunFailedError, match="more than failure.max_restarts=0"):
        run(job, fail_at=[5], progress=None)
    lease = lease_of(job)
    assert lease is not None and lease.released

    # Every snapshot of its storage damaged: the shadow refuses the run in one line (an input that cannot run), the
    # lease released again, and Ray prints no traceback: the shadow's constructor returns and its `ready` raises.
    for info in SnapshotStore(job.run_url, create=False).committed():
        with open(f"{info.url}/model.safetensors", "r+b") as f:
            f.seek(-10, 2)
            f.write(bytes([f.read(1)[0] ^ 0xFF]))
    with pytest.raises(JobConfigError, match=r"cannot be resumed: every committed snapshot under .* is corrupt"):
        run(job, progress=None)
    assert lease_of(job).released

    # A trainer that refuses in its constructor: Ray prints no traceback, as the constructor returns and the first
    # call raises the error (the controller makes it the run's one line: test_controller.py).
    trainer = TrainerActor.remote(job.model_dump(mode="json"), FaultInjection(build_error="no weights here"))
    assert ray.get(trainer.pid.remote()) > 0  # alive: Ray has no constructor's error to print
    with pytest.raises(WorkloadError, match="no weights here"):  # the error itself, from its first call
        ray.get(trainer.recovery.remote())
    ray.kill(trainer)
    assert "creation task" not in capfd.readouterr().err  # neither the shadow's nor a trainer's


def test_extending_a_finished_run_works_at_once_with_a_profile_or_without_one(tmp_path):
    first = profiled_job(tmp_path, steps=20)
    run(first, progress=None)
    profile = profile_steps(first)
    # Fewer steps left than the startup profile takes: the run goes on without one.
    shorter = profiled_job(tmp_path, steps=20 + profile - 1)
    summary = run(shorter, progress=None)
    assert summary.profile is None and summary.resumed_from_step == 20
    # Enough for a profile: the shadow comes back from storage with nothing written yet, and the profile
    # makes the image of the step it reached durable to time a snapshot write (not a write of 0 s).
    longer = profiled_job(tmp_path, steps=shorter.steps + profile + 5)
    lines = []
    extended = run(longer, progress=lines.append)
    assert f"  resumed at step {shorter.steps} from durable storage (its newest sound snapshot and the logged " \
           "records after it)" in lines
    assert extended.resumed_from_step == shorter.steps
    assert extended.profile is not None and extended.profile.timings.persist_seconds > 0
    expected = uninterrupted_hashes(longer)
    assert_exact(summary, expected, steps=shorter.steps)
    assert_exact(extended, expected, steps=longer.steps)


def test_a_second_job_is_refused_while_a_run_runs_and_the_finished_run_released_its_lease_and_runs_again(tmp_path):
    """While a run runs, a second job with its run id is refused before any actor starts; once the run has
    finished, its lease is released and running it again says what is durable and which kernels ran."""
    job = job_for(tmp_path, steps=12)
    refusals = []

    def second_job(progress, metrics):
        if not refusals:
            before = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
            with pytest.raises(JobConfigError) as refused:
                run(job.model_copy(update={"storage": str(tmp_path / "elsewhere")}), progress=None)
            after = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
            refusals.append((str(refused.value), before, after))

    summary = run(job, progress=None, on_segment=second_job)  # the first job goes on, exact
    assert summary.final_state_hash == uninterrupted_hashes(job)[12]
    ((message, before, after),) = refusals
    assert before == after  # nothing was started for the second job
    assert f"run {job.run_id!r} is already running on this Ray cluster" in message
    assert shadow_name(job.run_id) in message and "ALIVE" in message  # the holder, named
    assert "stop that job" in message and "another run_id" in message  # what to do

    lease = lease_of(job)
    assert lease is not None and lease.released  # the next writer, on any cluster, takes it at once
    again = run(job, progress=None)
    assert again.resumed_from_step == 12 and again.steps == 12
    assert again.final_state_hash == again.shadow_state_hash == uninterrupted_hashes(job)[12]
    table = dict(result_table(again))
    assert table["durable"].startswith("snapshot 12, log through step 11;")
    assert table["trainer kernels"] == f"{again.kernel.device}: {again.kernel.backend}"
    assert table["resumed"] == ("at step 12, from durable storage (its newest sound snapshot and the logged records "
                                "after it); 0 steps trained after it")
    assert table["shadow replay per step"] == "- (nothing replayed)"
    assert "held-out before" in table and not any("step 0" in key for key in table)
    assert not any("None" in value for value in table.values()), table


def test_a_job_whose_run_another_job_claimed_is_refused_and_touches_nothing_of_it(tmp_path):
    """Another job of the run holds its shadow's name, the run's claim: a job is refused by the start-up check where
    the holder is there before it, and by Ray's refusal of the name where it appears after the check (two jobs
    started together); either way the holder is untouched and nothing of the refused job stays."""
    job = job_for(tmp_path, steps=12)

    @ray.remote(num_cpus=0)
    class Holder:  # another job's shadow
        def pid(self) -> int:
            import os

            return os.getpid()

    held = Holder.options(name=shadow_name(job.run_id), namespace=NAMESPACE).remote()
    pid = ray.get(held.pid.remote())
    try:
        with pytest.raises(JobConfigError, match=rf"run '{job.run_id}' is already running on this Ray cluster: "
                                                 rf"its shadow zocheck-shadow-{job.run_id} is ALIVE"):
            run(job, progress=None)
        # the same where the other job's shadow appears after the checks, as this job makes its claim
        placement = Placement(job, Startup(task=None, gpus=0, resume_step=None, faults=None))
        with pytest.raises(JobConfigError, match=rf"run '{job.run_id}' is already running on this Ray cluster: "
                                                 rf"another job of the run created its shadow zocheck-shadow-"
                                                 rf"{job.run_id} a moment before this one did"):
            placement.start()
        assert ray.get(held.pid.remote()) == pid  # the holder is untouched
        assert [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)] == [shadow_name(job.run_id)]
        assert not [g for g in ray.util.placement_group_table().values()
                    if g["name"].startswith(f"zocheck-{job.run_id}") and g["state"] != "REMOVED"]
    finally:
        ray.kill(held)
