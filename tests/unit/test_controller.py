"""The controller, one step at a time, without Ray: every row of docs/architecture.md's failure table.

A fake trainer group and a fake shadow client stand in for the Ray actors (as Ray Train v2's controller
tests use a dummy worker group): each test scripts what the processes do at which step, and checks the
state the controller goes through and how the run ends.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from zocheck_ray.config import JobConfig, JobConfigError
from zocheck_ray.control.controller import Controller, State
from zocheck_ray.control.outcomes import Restored, StepTimes
from zocheck_ray.control.policy import Failure
from zocheck_ray.control.stop import RunStopped, StopRequest
from zocheck_ray.control.summary import RunFailedError
from zocheck_ray.runtime.errors import DrainFailedError, ShadowCallError, ShadowGoneError
from zocheck_ray.runtime.messages import KernelInfo, PublisherStats, RecoveryInfo, ShadowMetrics, ShadowStatus, TrainerProgress

HASH = "ab" * 32
STEPS = 20


class FakeShadow:
    """The run's shadow as the controller sees it: what it holds, and the faults a test schedules."""

    def __init__(self, job: JobConfig):
        self.job = job
        self.received = 0
        self.incarnation = "shadow-1"
        self.lag = 0
        self.replay_error: str | None = None
        self.writer_lost: str | None = None
        self.undurable = 0
        self.gone = False
        self.drain_errors: list[Exception] = []
        self.resyncs: list[int] = []
        self.aborted = 0
        self.closed = False

    def metrics(self, trainers=None) -> ShadowMetrics:
        if self.gone:
            raise ShadowGoneError("the shadow's process died and will not be restarted")
        return ShadowMetrics(
            run_id=self.job.run_id, incarnation=self.incarnation, trainer_step=self.received,
            received_step=self.received, replayed_step=self.received - self.lag, lag_steps=self.lag, lag_seconds=0.0,
            replay_seconds_per_step=0.001, snapshot_interval=4, snapshot_step=self.received,
            durable_step=self.received, durable_log_step=max(self.received - 1, 0), undurable_steps=self.undurable,
            persist_in_flight=False, last_persist_seconds=0.01, snapshots_taken=1, snapshots_persisted=1,
            resync_count=len(self.resyncs), rejected_records=0, persist_failures=0, persist_failing_seconds=0.0,
            regime="keep-pace", source="memory", replay_error=self.replay_error,
            persist_stopped=self.writer_lost is not None, persist_error=self.writer_lost)

    def status(self) -> ShadowStatus:
        """The status alone, as the controller asks between segments."""
        return self.metrics().status

    def drain(self, step, timeout, incarnation=None) -> ShadowMetrics:
        if self.drain_errors:
            raise self.drain_errors.pop(0)
        return self.metrics()

    def resync(self, step):
        self.resyncs.append(step)
        self.lag = 0
        self.replay_error = None

    def abort_intake(self):
        self.aborted += 1

    def replica_hash(self):
        return self.received, HASH

    def close(self, timeout):
        self.closed = True
        return True, None

    def profile_replay(self, threads):
        return 0.001

    def profile_snapshot(self):
        raise ShadowCallError("the snapshot stage failed: out of memory")

    def last_persist_seconds(self):
        return 0.01


class FakeGroup:
    """The trainer ranks: they train to the target unless a test scheduled a loss at a step on the way."""

    def __init__(self, job: JobConfig, shadow: FakeShadow):
        self.job, self.shadow = job, shadow
        self.k = job.scaling.trainers
        self.step = 0
        self.times = StepTimes([0.0] * self.k, [0] * self.k)
        self.durable_next = None
        self.lose_at: dict[int, tuple[int, ...]] = {}
        """Step -> the ranks whose processes die there."""
        self.gap_at: set[int] = set()
        """Steps at which the publisher finds records that no process holds any more."""
        self.records_lost_in_drain = False
        self.cannot_restart = False
        self.lose_shadow_with_trainer = False
        self.recovered: list[Failure] = []

    def start(self) -> RecoveryInfo:
        return RecoveryInfo(incarnation="trainer-1", step=0, source="fresh")

    def start_standby(self):
        pass

    changes = []  # an elastic group's shrinks and joins

    def grow(self, step):
        return None

    def trainer_times(self):
        return None

    def _progress(self, rank: int, gap: str | None = None) -> TrainerProgress:
        publisher = PublisherStats(held_records=0, resent_records=0, delivered_records=self.step,
                                   shadow_restarts_seen=0, publish_errors=0, last_publish_error=None, gap=gap)
        return TrainerProgress(step=self.step, loss=1.0, rank=rank, publisher=publisher,
                               kernel=KernelInfo(device="cpu", backend="eager"), step_seconds=[0.01])

    def run(self, target: int, step: int):
        while self.step < target:
            if self.step in self.lose_at:
                lost = self.lose_at.pop(self.step)
                if self.lose_shadow_with_trainer:  # the node: Ray restarts the shadow too, from storage
                    self.shadow.incarnation = "shadow-2"
                results = {r: self._progress(r) for r in range(self.k) if r not in lost}
                return results, Failure("trainer_lost", self.step, f"ranks lost {list(lost)}", ranks=lost)
            self.step += 1
            self.shadow.received = self.step
        gap = None
        if self.step in self.gap_at:
            self.gap_at.discard(self.step)
            gap = f"records {self.step - 2}..{self.step - 1} are held by no process"
        return {r: self._progress(r, gap) for r in range(self.k)}, None

    def recover(self, failure: Failure) -> Restored | Failure:
        self.recovered.append(failure)
        if self.cannot_restart:
            return Failure("trainer_gone", failure.step, "rank 0: the actor died permanently")
        self.step = self.shadow.received
        info = RecoveryInfo(incarnation="trainer-2", step=self.step, source="memory", image_step=self.step,
                            replayed_records=0)
        return Restored(failure.ranks[0] if failure.ranks else 0, info, "restart", {"restart": 0.1})

    def export_to_shadow(self, step: int):
        return self.step

    def resynced(self, step: int):
        pass

    def deliver(self, step: int):
        if self.records_lost_in_drain:
            self.records_lost_in_drain = False
            self.shadow.received = self.step - 2  # the ranks' last two records went with a lost shadow
            return self.shadow.received
        self.shadow.received = self.step
        return self.step

    def state_hashes(self, step: int):
        return [(self.step, HASH)] * self.k

    def resent_records(self) -> int:
        return 0

    def kernel(self) -> KernelInfo:
        return KernelInfo(device="cpu", backend="eager")


class FakeParts:
    def __init__(self, job: JobConfig):
        self.shadow = FakeShadow(job)
        self.group = FakeGroup(job, self.shadow)
        self.stopped = False

    def start(self):
        return self.shadow, self.group

    def stop(self) -> bool:
        self.stopped = True
        return True


class FakeTask:
    metric = "loss"

    def summary(self) -> dict:
        return {"kind": "fake"}


def controller(tmp_path, stop: StopRequest | None = None, **fields) -> tuple[Controller, FakeParts]:
    shadow = {"snapshot_interval": 4, **fields.pop("shadow", {})}
    job = JobConfig(run_id="unit", steps=STEPS, log_interval=5, shadow=shadow, storage=str(tmp_path), **fields)
    parts = FakeParts(job)
    return Controller(job, FakeTask(), parts, stop=stop), parts


def states(run: Controller) -> list[str]:
    return [s for s in run.record.states if s not in ("starting",)]


def test_an_uninterrupted_run_goes_from_starting_to_done_and_ends_every_process(tmp_path):
    run, parts = controller(tmp_path)
    summary = run.run()
    assert summary.steps == STEPS and summary.final_state_hash == summary.shadow_state_hash == HASH
    assert set(states(run)) == {"running", "finishing", "done"}
    assert parts.shadow.closed and parts.stopped


def test_a_lost_rank_is_restarted_and_the_run_goes_on(tmp_path):
    run, parts = controller(tmp_path)
    parts.group.lose_at[7] = (0,)
    summary = run.run()
    assert [f.kind for f in parts.group.recovered] == ["trainer_lost"]
    assert "recovering" in states(run) and summary.steps == STEPS
    (recovery,) = summary.recoveries
    assert recovery.failed_at_step == 7 and recovery.recovered_step == 7 and recovery.replaced_by == "restart"
    assert run.budget.spent == 1


def test_more_lost_trainers_than_max_restarts_fail_the_run_and_say_what_to_do(tmp_path):
    run, parts = controller(tmp_path, failure={"max_restarts": 1})
    parts.group.lose_at.update({3: (0,), 12: (0,)})
    with pytest.raises(RunFailedError, match="more than failure.max_restarts=1: raise it"):
        run.run()
    assert len(parts.group.recovered) == 1 and states(run)[-1] == "failed" and parts.stopped


def test_a_shadow_beyond_the_lag_bound_is_resynced(tmp_path):
    run, parts = controller(tmp_path, shadow={"max_lag_steps": 2})
    original = parts.group.run

    def lagging(target, step):
        results, failure = original(target, step)
        if step == 5:
            parts.shadow.lag = 3
        return results, failure

    parts.group.run = lagging
    summary = run.run()
    assert parts.shadow.resyncs == [10] and "resyncing" in states(run)
    assert summary.resyncs == [(10, "the shadow lags more than 2 steps (shadow.max_lag_steps)")]


class SlowReplayShadow(FakeShadow):
    """A shadow whose replay is slower than the trainer's step: the startup profile's cost model sets a lag bound."""

    def profile_replay(self, threads):
        return 0.05

    def profile_snapshot(self):
        return 0.001

    def end_profile(self, threads, snapshot_interval, regime, durable_interval):
        self.regime = regime


def test_a_resync_names_the_lag_bound_the_cost_model_gave(tmp_path):
    job = JobConfig(run_id="unit", steps=60, log_interval=5, storage=str(tmp_path),  # no max_lag_steps: profiled
                    failure={"mtbf_hours": 0.01})
    parts = FakeParts(job)
    parts.shadow = SlowReplayShadow(job)
    parts.group.shadow = parts.shadow
    run = Controller(job, FakeTask(), parts)
    original = parts.group.run

    def lagging(target, step):
        results, failure = original(target, step)
        if run.state is State.RUNNING and step >= 40 and not parts.shadow.resyncs:
            parts.shadow.lag = run.lag_bound.steps + 1
        return results, failure

    parts.group.run = lagging
    summary = run.run()
    assert parts.shadow.regime == "lag" and run.lag_bound.source == "the cost model's bound from the startup profile"
    bound = run.lag_bound.steps
    assert bound != job.shadow.max_lag_steps and summary.resyncs
    assert summary.resyncs[0][1] == f"the shadow lags more than {bound} steps (the cost model's bound from the " \
                                    "startup profile)"


def test_a_replay_that_stopped_is_resynced(tmp_path):
    run, parts = controller(tmp_path)
    parts.shadow.replay_error = "the replay stage failed: a record of another run"
    summary = run.run()
    assert parts.shadow.resyncs == [5] and summary.resyncs == [(5, "the shadow's replay stopped")]


def test_records_no_process_holds_mid_run_restore_every_rank_without_spending_the_budget(tmp_path):
    run, parts = controller(tmp_path, failure={"max_restarts": 0})
    parts.group.gap_at.add(10)
    summary = run.run()
    assert [f.kind for f in parts.group.recovered] == ["records_lost"] and run.budget.spent == 0
    assert summary.steps == STEPS


def test_records_no_process_holds_in_the_final_drain_restore_and_train_those_steps_again(tmp_path):
    run, parts = controller(tmp_path, failure={"max_restarts": 0})
    parts.group.records_lost_in_drain = True
    summary = run.run()
    assert [f.kind for f in parts.group.recovered] == ["records_lost"]
    assert states(run).count("finishing") == 2 and summary.steps == STEPS


def test_a_restarted_shadow_needs_no_decision_and_is_counted(tmp_path):
    run, parts = controller(tmp_path)
    original = parts.group.run

    def shadow_restarts(target, step):
        if step == 10:
            parts.shadow.incarnation = "shadow-2"  # Ray restarted it from durable storage
        return original(target, step)

    parts.group.run = shadow_restarts
    summary = run.run()
    assert summary.shadow_restarts == 1 and not parts.group.recovered
    assert any("the shadow restarted" in w for w in summary.warnings)


def test_a_lost_node_restarts_the_trainer_and_the_shadow_rebuilt_from_storage(tmp_path):
    run, parts = controller(tmp_path)
    parts.group.lose_shadow_with_trainer = True
    parts.group.lose_at[8] = (0,)
    summary = run.run()
    assert [f.kind for f in parts.group.recovered] == ["trainer_lost"]
    assert summary.shadow_restarts == 1 and summary.steps == STEPS


@pytest.mark.parametrize("fault,message", [
    ("durability", "steps are not durable in"),
    ("writer", "one writer per run"),
    ("drain", "the final state could not be made durable: storage refused the snapshot"),
    ("restart", "the trainer cannot be restarted"),
    ("shadow", "the shadow cannot be restarted"),
])
def test_what_cannot_go_on_fails_the_run_with_what_to_do_and_ends_every_process(tmp_path, fault, message):
    run, parts = controller(tmp_path, durability={"max_undurable_steps": 3})
    if fault == "durability":
        parts.shadow.undurable = 4
    elif fault == "writer":
        parts.shadow.writer_lost = "another writer holds the run's lease"
    elif fault == "drain":
        parts.shadow.drain_errors.append(DrainFailedError("storage refused the snapshot"))
    elif fault == "restart":
        parts.group.cannot_restart = True
        parts.group.lose_at[6] = (0,)
    else:
        original = parts.group.run

        def shadow_gone(target, step):
            parts.shadow.gone = step >= 5
            return original(target, step)

        parts.group.run = shadow_gone
    with pytest.raises(RunFailedError, match=message):
        run.run()
    assert states(run)[-1] == "failed" and parts.stopped


def test_a_stop_signal_makes_the_shadow_durable_at_the_next_boundary_and_stops(tmp_path):
    stop = StopRequest()
    run, parts = controller(tmp_path, stop=stop)
    original = parts.group.run

    def signalled(target, step):
        if step == 10:
            stop.signum = signal.SIGTERM
        return original(target, step)

    parts.group.run = signalled
    with pytest.raises(RunStopped) as stopped:
        run.run()
    assert stopped.value.signum == signal.SIGTERM and "stopped by SIGTERM at step 15" in str(stopped.value)
    assert states(run)[-2:] == ["stopping", "stopped"] and parts.shadow.closed and parts.stopped


def test_the_controller_imports_no_ray():
    code = "import sys, zocheck_ray.control.controller; print('ray' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def test_a_startup_profile_that_fails_in_the_shadow_fails_the_run_with_its_cause(tmp_path):
    run, parts = controller(tmp_path, shadow={"snapshot_interval": None})
    with pytest.raises(RunFailedError, match="the startup profile failed in the shadow: the snapshot stage failed"):
        run.run()
    assert "profiling" in states(run) and states(run)[-1] == "failed" and parts.stopped


class RayReport(RuntimeError):
    """Stands for Ray's report of a remote call's error (`RayTaskError`): its text, and the error as `cause`."""

    def __init__(self, cause: Exception):
        super().__init__(f"The actor died because of an error raised in its creation task\n  File ...\n{cause!r}")
        self.cause = cause


def test_trainers_that_cannot_take_their_first_state_fail_the_run_in_one_line_naming_the_cause(tmp_path):
    from zocheck_ray.runtime.errors import StageError

    run, parts = controller(tmp_path)
    report = RayReport(StageError("the initial image could not be made durable: storage is full"))
    parts.group.start = lambda: (_ for _ in ()).throw(report)  # as Ray reports a constructor's error
    with pytest.raises(RunFailedError, match="failed at step 0: the trainers could not start: the initial image could "
                                             "not be made durable: storage is full$"):
        run.run()
    assert states(run)[-1] == "failed" and parts.stopped and parts.shadow.closed
    run, parts = controller(tmp_path)
    parts.group.start = lambda: (_ for _ in ()).throw(RuntimeError("not ours"))
    with pytest.raises(RuntimeError, match="not ours"):  # anything else keeps its traceback
        run.run()


def test_a_shadow_that_finds_every_snapshot_damaged_refuses_the_storage_as_an_input_that_cannot_run(tmp_path):
    run, parts = controller(tmp_path)
    from zocheck_ray.storage import CorruptSnapshotError

    report = RayReport(CorruptSnapshotError("every committed snapshot under R is corrupt: R/x fails its SHA-256 check "
                                            "(the file is damaged); nothing was deleted: restore the damaged files "
                                            "from a copy"))
    parts.start = lambda: (_ for _ in ()).throw(report)  # as Ray reports the shadow's constructor
    with pytest.raises(JobConfigError, match=f"^storage='{tmp_path}' cannot be resumed: every committed snapshot "
                                             "under R is corrupt: R/x fails its SHA-256 check .* from a copy$"):
        run.run()  # exit 2 from the CLI, like the sizes' check before Ray
    assert parts.stopped


def test_with_dev_rows_the_shadow_is_told_every_dev_loss_after_each_segment_and_again_after_it_restarted(tmp_path):
    run, parts = controller(tmp_path, task={"num_train": 8, "num_dev": 4, "eval_interval": 8})
    dev_loss = {0: 0.9, 8: 0.3, 16: 0.4, 20: 0.3}
    told: list[tuple[dict, int]] = []
    parts.shadow.note_dev = lambda losses, through: told.append((dict(losses), through))
    original = parts.group.run

    def evaluating(target, step):
        results, failure = original(target, step)
        evaluations = {s: {"loss": 1.0, "dev_loss": dev_loss[s]} for s in dev_loss if step <= s <= parts.group.step}
        if step == 5:
            parts.shadow.incarnation = "shadow-2"  # Ray restarted it: it is told everything again
        return {r: p.model_copy(update={"evaluations": evaluations}) for r, p in results.items()}, failure

    parts.group.run = evaluating
    summary = run.run()
    assert [through for _, through in told] == [0, 8, 8, 20]  # each new evaluation, and again after the restart
    assert told[2] == told[1] and told[-1] == (dev_loss, 20)
    assert summary.best_dev_step == 8  # the first of the lowest (8 and 20)
