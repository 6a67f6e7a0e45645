"""Data-parallel ZO on real Ray: k trainer ranks, one gloo process group, one shadow.

Every rank evaluates its slice of the step's batch; the ranks all-gather their loss sums
and stay bit-identical replicas. A run of k ranks (with or without a lost rank) must equal
a plain loop that evaluates the same k slices and adds their sums in rank order, at every
step; every rank and the shadow must end with the same state; the durable log must
replay to every step with no gap.
"""

import json

import pytest
import ray
import yaml

from reference_runs import job_for, uninterrupted_data_parallel_hashes, uninterrupted_hashes
from support import PausableS3, wait_until
from zocheck_ray.config import JobConfigError, load_job_config
from zocheck_ray.control import Action, Failure, FailureBudget, decide
from zocheck_ray.testing import run_with_faults as run
from zocheck_ray.verify import verify_run


RAY_CPUS = 5
"""Logical CPUs the local Ray instance has at least (`conftest.local_ray`)."""
# k trainer ranks on a real Ray instance, ranks killed; local_ray: the local Ray instance
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]


STEPS = 24


TASK = dict(batch_size=6, max_length=32, eval_size=16, eval_interval=10)
SHARDED = dict(TASK, shards=6)
"""Six shards of one row: any k from 1 to 6 ranks gives the bits of the one-trainer 6-shard run."""


def dp_job(tmp_path, trainers=2, **kw):
    fields = dict(scaling={"trainers": trainers}, steps=STEPS, task=TASK)
    fields.update(kw)
    return job_for(tmp_path, **fields)


def assert_replicas_exact(summary, job, verify=True):
    expected = uninterrupted_data_parallel_hashes(job)
    assert summary.steps == STEPS
    assert summary.final_state_hash == summary.shadow_state_hash == expected[STEPS]
    assert summary.step_hashes
    for step, digest in summary.step_hashes.items():
        assert digest == expected[step], f"state after step {step} differs"
    assert summary.trainers == job.scaling.trainers
    assert summary.rank_state_hashes == [expected[STEPS]] * job.scaling.trainers
    assert not [w for w in summary.warnings if "differs" in w]
    if verify:
        verification = verify_run(job, summary)  # the durable log, replayed, meets every hashed step: no gap
        assert verification.verified, verification.mismatches


def test_bad_input_fails_before_any_actor(tmp_path):
    with pytest.raises(JobConfigError, match="scaling.trainers"):
        load_job_config(overrides=["scaling.trainers=0"])
    with pytest.raises(JobConfigError, match="task.batch_size=4 does not divide among scaling.trainers=3"):
        load_job_config(overrides=["scaling.trainers=3", "task.batch_size=4"])
    with pytest.raises(JobConfigError, match="task.batch_size=6 does not divide into task.shards=4"):
        load_job_config(overrides=["task.batch_size=6", "task.shards=4"])
    with pytest.raises(JobConfigError, match="task.shards=2 is fewer than scaling.trainers=3"):
        load_job_config(overrides=["scaling.trainers=3", "task.batch_size=6", "task.shards=2"])
    with pytest.raises(JobConfigError, match="scaling.trainers: min=3 must be at least 1 and at most max=2"):
        load_job_config(overrides=["scaling.trainers={min: 3, max: 2}", "task.batch_size=6"])
    with pytest.raises(JobConfigError, match="scaling.placement"):
        load_job_config(overrides=["scaling.trainers=2", "scaling.placement=everywhere"])
    with pytest.raises(JobConfigError, match="scaling.trainers=6 with scaling.placement=pack"):
        run(dp_job(tmp_path, trainers=6), progress=None)
    with pytest.raises(JobConfigError, match="scaling.trainers=6 plus shadow.cpus=1 need 7 CPUs"):
        run(dp_job(tmp_path, scaling={"trainers": 6, "placement": "spread"}), progress=None)
    with pytest.raises(JobConfigError, match="fail_rank=2"):
        run(dp_job(tmp_path), fail_at=[10], fail_rank=2, progress=None)
    assert not ray.util.list_named_actors(all_namespaces=True)


def test_a_lost_rank_is_restarted_within_the_failure_budget():
    job = dp_job("/tmp")
    budget = FailureBudget(job.failure.max_restarts)
    failure = Failure("trainer_lost", 12, "injected", mode="software", ranks=(1,))
    assert all(decide(failure, job, budget).action is Action.RESTART for _ in range(job.failure.max_restarts))
    decision = decide(failure, job, budget)
    assert decision.action is Action.FAIL and "failure.max_restarts" in decision.reason


@pytest.mark.ray_range
def test_two_ranks_lose_rank_0_and_equal_the_plain_loop(tmp_path):
    job = dp_job(tmp_path)
    seen = []  # what `zocheck-ray status` shows mid-run: every rank's step time and the all-gather's
    summary = run(job, fail_at=[13], fail_rank=0, progress=None, on_segment=lambda last, metrics: seen.append(metrics))
    assert seen and all(len(m.rank_seconds_per_step) == 2 and min(m.rank_seconds_per_step) > 0
                        and m.collective_seconds_per_step > 0 for m in seen)
    (recovery,) = summary.recoveries
    assert recovery.rank == 0 and recovery.failed_at_step == 13
    assert recovery.recovered_step == 13  # the survivor handed the shadow every record before the failure
    assert recovery.image_source == "memory"
    assert_replicas_exact(summary, job)
    assert len(summary.rank_seconds_per_step) == 2 and all(s > 0 for s in summary.rank_seconds_per_step)
    assert summary.collective_seconds_per_step is not None and summary.collective_seconds_per_step > 0


def test_the_cli_kills_rank_1_and_the_run_stays_exact(tmp_path, capsys):
    """Several perturbations and micro-batches compose with the ranks: n-SPSA (q = 2: two all-gathers a step)
    and gradient accumulation (each rank's slice of 3 rows in micro-batches of 2 and 1), ZO-SGD-Cons (its
    decision formed from gathered losses too); `zocheck-ray train --fail-rank 1` loses rank 1."""
    from zocheck_ray.cli import main
    from zocheck_ray.control import RunSummary

    job = dp_job(tmp_path / "runs", optimizer="zo-sgd-cons", zo=dict(optimizer="zo-sgd-cons", lr=2e-3, eps=1e-3,
                                                                      num_perturbations=2),
                 task=dict(batch_size=6, max_length=32, eval_size=16, eval_interval=10, micro_batch_size=2))
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job.model_dump(mode="json")))
    out = tmp_path / "summary.json"
    assert main(["train", "--config", str(config), "--fail-at", "13", "--fail-rank", "1", "--verify",
                 "--json", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "every rank == shadow" in shown and "rank 1: " in shown
    doc = json.loads(out.read_text())
    assert doc["verification"]["verified"]
    doc.pop("verification")
    summary = RunSummary.model_validate(doc)
    assert [(r.rank, r.failed_at_step) for r in summary.recoveries] == [(1, 13)]
    assert_replicas_exact(summary, job, verify=False)  # `--verify` did


@pytest.mark.usefixtures("one_torch_thread")  # as each rank computes: one-row forward passes differ with threads
def test_one_two_and_three_ranks_with_the_same_shards_give_the_same_bits(tmp_path):
    # The answer depends on the shards, not on the ranks: k = 1, 2, 3 with S = 6 is the one-trainer 6-shard run.
    steps = 6
    expected = uninterrupted_data_parallel_hashes(dp_job(tmp_path / "reference", trainers=1, steps=steps,
                                                         task=SHARDED))
    for k in (1, 2, 3):
        job = dp_job(tmp_path / f"k{k}", trainers=k, steps=steps, task=SHARDED)
        summary = run(job, progress=None)
        assert summary.final_state_hash == summary.shadow_state_hash == expected[steps], f"k={k}"
        assert summary.rank_state_hashes == [expected[steps]] * k
        assert all(digest == expected[step] for step, digest in summary.step_hashes.items()), f"k={k}"


def test_two_slices_are_not_the_single_trainer_run(tmp_path):
    # The reference of k ranks is k's own: slices of 3 rows summed in float64 are not one mean over 6 rows.
    job = dp_job(tmp_path, steps=2)
    assert uninterrupted_data_parallel_hashes(job)[2] != uninterrupted_hashes(job)[2]


def test_a_tune_trial_reserves_every_rank_and_the_shadow():
    from zocheck_ray.config import JobConfig
    from zocheck_ray.tune import trial_resources

    pgf = trial_resources(JobConfig(scaling={"trainers": 3}, shadow={"cpus": 2}, task=dict(batch_size=6)), gpus=1)
    assert pgf.strategy == "STRICT_PACK"
    assert pgf.bundles == [{"CPU": 1}, {"CPU": 1, "GPU": 1}, {"CPU": 2}, {"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}]
    assert trial_resources(JobConfig(scaling={"trainers": 2, "placement": "spread"})).strategy == "PACK"


def test_a_holding_rank_keeps_records_until_durable_and_delivers_what_the_shadow_lacks():
    from zocheck_ray.runtime.publisher import Publisher, PushReply, poll_answered
    from zocheck_ray.core import StepRecord

    class Shadow:  # an in-process shadow that expects step 5 and has made steps before 3 durable
        pushes = []

        def push(self, data, trainer_step):
            from zocheck_ray.core.record import decode_records

            records = decode_records(data)
            self.pushes.append([r.step for r in records])
            return PushReply("one", 5 + len([r for r in records if r.step >= 5]), 3, len(records))

        poll = staticmethod(poll_answered)

    shadow = Shadow()
    publisher = Publisher(shadow, 3, lambda: 8, publishing=False)
    for step in range(3, 8):
        publisher.append(StepRecord(step, step, 0.5, 1e-3, 1e-3, 12345, "zo-sgd"))
    publisher.tick()
    assert shadow.pushes == [] and publisher.held_records == 5  # a holding rank never sends on its own
    publisher.acknowledge(4)
    assert publisher.held_records == 4
    assert publisher.deliver() == 8  # asked what the shadow expects (5), then handed it 5, 6, 7
    assert shadow.pushes == [[], [5, 6, 7]]



@pytest.mark.usefixtures("one_torch_thread")
def test_a_lost_rank_leaves_the_others_training_on_its_shards(tmp_path):
    # An elastic group of 3: rank 0 is lost at +eps of step 4, a snapshot step (the records of the image in flight
    # went with it), and rank 2 as the group re-forms, before it reaches the new rendezvous. The others take the
    # lost ranks' shards at the perturbation they stand at, twice, without a restore from the shadow; the one left
    # waiting at the rendezvous goes to the next plan rather than wait for the store's timeout. Rank 1 becomes the
    # rank that sends the records: the shadow's log has no gap. (Rank 1 of 3 lost at -eps: the join test's shrink.)
    from zocheck_ray.runtime.injection import FaultInjection

    steps, at = 8, 4
    job = dp_job(tmp_path, trainers={"min": 1, "max": 3}, steps=steps, task=SHARDED, shadow={"snapshot_interval": at})
    expected = uninterrupted_data_parallel_hashes(job)
    faults = FaultInjection(die_at_exchange={0: [(at, 0)]}, die_at_regroup={2: [1]}, marker_dir=str(tmp_path))
    summary = run(job, faults=faults, progress=None)
    assert summary.recoveries == []  # nobody restored from the shadow
    first, second, *joins = summary.group_changes  # Ray's restarts may join before the end
    assert [(c.kind, c.step, c.ranks, c.cause) for c in (first, second)] == [
        ("shrink", at, 2, "rank 0 lost"), ("shrink", at, 1, "rank 1 lost")]
    assert 0 < first.plan_wait_seconds < first.stall_seconds  # the plan came, then the shards were evaluated
    assert all(c.kind == "join" for c in joins)
    assert summary.final_state_hash == summary.shadow_state_hash == expected[steps]
    assert summary.rank_state_hashes == [expected[steps]] * (1 + len(joins))
    assert summary.step_hashes and all(digest == expected[step] for step, digest in summary.step_hashes.items())
    verification = verify_run(job, summary)
    assert verification.verified, verification.mismatches


@pytest.mark.usefixtures("one_torch_thread")
def test_the_restarted_process_joins_at_a_step_boundary_and_takes_shards(tmp_path, aws_env):
    # Rank 1 of 3 is lost at step 5 at -eps (after an exchange at +eps that had its losses) while the shadow holds
    # the snapshot of step 4 open (its storage paused, the image not durable). The others go on at k=2 while Ray
    # restarts its process, which then joins from that image and the records after it at a step boundary: k=3
    # again, every rank and the shadow exact, and the durable log whole once the storage answers again.
    from zocheck_ray.control.callbacks import RunCallback
    from zocheck_ray.runtime.injection import FaultInjection

    steps, snapshot, lost = 12, 4, 5
    server = PausableS3()

    class SnapshotOpenUntilJoined(RunCallback):
        def on_segment(self, run, segment):
            step = segment.progress.step
            if step == snapshot - 2:  # paused from a settled state: nothing in flight
                assert wait_until(lambda: (m := run.shadow.metrics()).replayed_step == step
                                  and m.durable_step == m.snapshot_step and not m.persist_in_flight), \
                    run.shadow.metrics()
                server.pause()
            elif step == snapshot:  # the image of step 4 taken, its save held
                assert wait_until(lambda: (m := run.shadow.metrics()).snapshot_step == snapshot
                                  and (m.durable_step or 0) < snapshot), run.shadow.metrics()
            for actor, _ in list(run.group.departed.values()):  # the lost process back, to join at this boundary
                ray.get(actor.readiness.remote())  # sent during Ray's restart, it waits for the new process
            if run.group.k == 3 and step > lost:
                server.resume()

    try:
        job = dp_job(tmp_path, trainers={"min": 2, "max": 3}, steps=steps, task=SHARDED, log_interval=2,
                     shadow={"snapshot_interval": snapshot}, storage=f"s3://{server.new_bucket()}/runs",
                     storage_options=server.options(), durability={"lease_seconds": 300})  # no pause outlasts it
        faults = FaultInjection(die_at_exchange={1: [(lost, 1)]}, marker_dir=str(tmp_path))
        summary = run(job, faults=faults, progress=None, callbacks=[SnapshotOpenUntilJoined()])
        expected = uninterrupted_data_parallel_hashes(job)
        verification = verify_run(job, summary)
    finally:
        server.close()
    assert [(c.kind, c.ranks) for c in summary.group_changes] == [("shrink", 2), ("join", 3)]
    shrink, join = summary.group_changes
    assert shrink.step == lost and shrink.held == [[0, 1, 2], [3, 4, 5]]  # rank 1's shards 2, 3 dealt round
    assert 0 < shrink.plan_wait_seconds < shrink.stall_seconds
    assert join.held == [[0, 1], [2, 3], [4, 5]] and join.step in (lost + 1, lost + 3) and "rank 2" in join.cause
    assert f"image of step {snapshot} and {join.step - snapshot} records" in join.cause  # the open snapshot
    # what `status` and the gauges show: k, each rank's shards, the changes
    m = summary.metrics
    assert (m.ranks, m.rank_shards, m.group_changes) == (3, join.held, 2)
    assert m.last_group_change.startswith(f"join at step {join.step} to 3 ranks")
    assert summary.recoveries == []
    assert summary.final_state_hash == summary.shadow_state_hash == expected[steps]
    assert summary.rank_state_hashes == [expected[steps]] * 3
    assert all(digest == expected[step] for step, digest in summary.step_hashes.items())
    assert verification.verified, verification.mismatches


@pytest.mark.usefixtures("one_torch_thread")
def test_the_ready_standby_joins_in_a_lost_ranks_stead_and_its_restarted_process_stands_by(tmp_path):
    # {min: 1, max: 2} with a warm standby: rank 1 is lost at +eps of step 3, rank 0 goes on alone, and at the
    # next step boundary the standby joins as rank 1 from the shadow's image and records, without waiting for Ray
    # to restart the lost process, which becomes the next standby. Exact.
    from zocheck_ray.control.callbacks import RunCallback
    from zocheck_ray.runtime.injection import FaultInjection

    steps = 8

    class StandbyReady(RunCallback):
        def on_segment(self, run, segment):
            if segment.progress.step == 6:  # Ray restarted the lost rank's process: it is the standby now
                assert run.group.standby_name.endswith("-rank1")
            if segment.progress.step in (2, 6):
                assert wait_until(run.group.prepare_standby)

    job = dp_job(tmp_path, trainers={"min": 1, "max": 2}, steps=steps, task=SHARDED, log_interval=2,
                 failure={"standby": True})
    faults = FaultInjection(die_at_exchange={1: [(3, 0)]}, marker_dir=str(tmp_path))
    summary = run(job, faults=faults, progress=None, callbacks=[StandbyReady()])
    expected = uninterrupted_data_parallel_hashes(job)
    shrink, join = summary.group_changes
    assert (shrink.kind, shrink.step, shrink.ranks) == ("shrink", 3, 1)
    assert (join.kind, join.step, join.ranks) == ("join", 4, 2)
    assert join.cause.startswith("the standby zocheck-trainer-") and "-rank1's stead: rank 1" in join.cause, join.cause
    assert summary.recoveries == []
    assert summary.final_state_hash == summary.shadow_state_hash == expected[steps]
    assert summary.rank_state_hashes == [expected[steps]] * 2
    assert all(digest == expected[step] for step, digest in summary.step_hashes.items())


def test_below_min_or_a_failed_exchange_with_every_rank_alive_every_rank_rejoins_from_the_shadow(tmp_path):
    # {min: 3, max: 3}. At step 1 rank 1 is slower than the collective's timeout: the others' exchange fails with
    # every rank alive, so the group is released and every rank rejoins from the shadow. At step 3 losing the
    # last of three ranks leaves too few: the survivors stop torn and the run recovers as a fixed one. Exact.
    from zocheck_ray.runtime.injection import FaultInjection

    steps = 6
    job = dp_job(tmp_path, steps=steps, task=SHARDED,
                 scaling={"trainers": {"min": 3, "max": 3}, "collective_timeout_seconds": 5})
    faults = FaultInjection(stall_at_exchange={1: [(1, 0)]}, die_at_exchange={2: [(3, 1)]},
                            marker_dir=str(tmp_path))
    summary = run(job, faults=faults, progress=None)
    expected = uninterrupted_data_parallel_hashes(job)
    assert summary.group_changes == []
    assert [(r.failed_at_step, r.replaced_by, r.rank) for r in summary.recoveries] == [(1, "torn", 0), (3, "restart", 2)]
    assert summary.final_state_hash == summary.shadow_state_hash == expected[steps]
    assert summary.rank_state_hashes == [expected[steps]] * 3
