"""The driver side: a state machine over one run's trainer group and its shadow.

    import zocheck_ray
    summary = zocheck_ray.run(zocheck_ray.JobConfig(steps=100))

STARTING -> PROFILING (sets the snapshot interval and the lag bound) -> RUNNING (one segment
of `log_interval` steps per turn) -> FINISHING (the final state made durable) -> DONE. A
failure in any state becomes a `Failure` that `decide` (control/policy.py) turns into
`Recovering`, `Resyncing` or `Failed`, states that carry their data. A stop signal turns the next
step boundary into STOPPING -> STOPPED. Everything the run reports goes through callbacks
(control/callbacks.py).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Iterable, Protocol, Union

from zocheck_ray.config import JobConfig, JobConfigError
from zocheck_ray.control.callbacks import RunCallback, RunRecord, Segment
from zocheck_ray.control.monitor import Monitor
from zocheck_ray.control.policy import Action, Failure, FailureBudget, LagBound, decide
from zocheck_ray.control.profile import DRAIN_SECONDS, profile_steps, startup_profile
from zocheck_ray.control.stop import RunStopped, StopRequest, signal_name
from zocheck_ray.control.summary import Recovery, RunFailedError, RunSummary
from zocheck_ray.runtime.errors import (
    DrainFailedError, ShadowCallError, ShadowGoneError, ShadowRestartedError, own_error,
)
from zocheck_ray.runtime.messages import ShadowMetrics, ShadowStatus, TrainerProgress, TrainerTimes
from zocheck_ray.storage import CorruptSnapshotError, LeaseError, StorageError
from zocheck_ray.storage.lease import release_dead_holder

PROFILE_TOLERANCE = 3.0
"""The startup profile's timings should agree with the run's steady state within this factor."""
DRAIN_ATTEMPTS = 5
"""How often the end of a run re-delivers the records to a shadow that restarted meanwhile."""
CLOSE_SECONDS = 60.0
"""Seconds the end of a run waits for the shadow to seal its log and release the lease."""


class State(enum.Enum):
    STARTING = "starting"
    PROFILING = "profiling"
    RUNNING = "running"
    RECOVERING = "recovering"
    RESYNCING = "resyncing"
    FINISHING = "finishing"
    STOPPING = "stopping"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclasses.dataclass(frozen=True)
class Recovering:
    """Lost trainers are replaced and every rank restores."""

    failure: Failure
    name = State.RECOVERING


@dataclasses.dataclass(frozen=True)
class Resyncing:
    """The shadow is reset from the trainer's state."""

    reason: str
    bound: LagBound
    """The lag bound in force when the resync was decided."""
    name = State.RESYNCING


@dataclasses.dataclass(frozen=True)
class Failed:
    """The run ends with `error`, at the step its failure was seen."""

    error: str
    step: int
    name = State.FAILED


Step = Union[State, Recovering, Resyncing, Failed]
"""A state of the run: a plain one, or one that carries its data."""


def state_name(state: Step) -> State:
    return state if isinstance(state, State) else state.name


ENDED = (State.DONE, State.FAILED, State.STOPPED)


class Parts(Protocol):
    """Where a run's processes come from and go: `control/placement.py` on Ray, fakes in the unit tests."""

    def start(self) -> tuple:
        """Start the run's shadow and trainers: (its `ShadowClient`, its `TrainerGroup`)."""

    def stop(self) -> bool:
        """End every process of the run; whether all are gone."""


class Controller:
    """Drives one run through its states, holding no Ray type (`parts` brings them), so the unit tests drive every
    row of the failure table without Ray."""

    def __init__(self, job: JobConfig, task, parts: Parts, callbacks: Iterable[RunCallback] = (),
                 stop: StopRequest | None = None, writer: str | None = None):
        """`writer`: the shadow's name in the run's lease, released here if the shadow could not."""
        self.job, self.task, self.parts, self.writer = job, task, parts, writer
        self.stop = stop or StopRequest()
        self.stopped: str | None = None
        """A stopped run's last line: where it stopped and what is durable."""
        self.record = RunRecord()
        self.callbacks: list[RunCallback] = [self.record, *callbacks]
        self.state: Step = State.STARTING
        self.step = 0
        self.group = None
        self.shadow = None
        self.budget = FailureBudget(job.failure.max_restarts)
        self.monitor = Monitor(job)
        self.lag_bound = LagBound.of_job(job)
        """The shadow's lag bound: the job's, else the cost model's once the startup profile gives one."""
        self.summary: RunSummary | None = None
        self._changes_reported = 0
        self._dev_told: tuple | None = None

    @property
    def max_lag_steps(self) -> int:
        return self.lag_bound.steps

    def run(self) -> RunSummary:
        self.stop.describe_now = lambda: (f"at step {self.step}, without waiting: the durable state under "
                                          f"{self.job.run_url} resumes the run once its lease goes stale "
                                          f"({self.job.durability.lease_seconds:g} s)")
        try:
            self._drive()
        except RunStopped as now:  # a second signal: nothing more is waited for
            self.state, self.stopped = State.STOPPED, str(now)
        finally:
            released = self._stop_actors(graceful=not self.stop.hurried)
        self._emit("on_state", state_name(self.state).value)
        if isinstance(self.state, Failed):
            raise RunFailedError(f"run {self.job.run_id} failed at step {self.state.step}: {self.state.error}")
        if self.state is State.STOPPED:
            line = self.stopped + ("; the run's lease is released" if released else "") + \
                "; run the same job again to resume it"
            self._emit("on_stopped", line)
            raise RunStopped(line, self.stop.signum)
        return self.summary

    def _drive(self) -> None:
        handlers = {State.STARTING: self._start, State.PROFILING: self._profile, State.RUNNING: self._running,
                    State.FINISHING: self._finish, State.STOPPING: self._stopping}
        carrying = {Recovering: self._recover, Resyncing: self._resync}
        while state_name(self.state) not in ENDED:
            self._emit("on_state", state_name(self.state).value)
            try:
                state = self.state
                self.state = handlers[state]() if isinstance(state, State) else carrying[type(state)](state)
            except _ShadowGone as gone:
                self.state = self._fail(gone.failure)
            if self.stop.requested and self.state in (State.PROFILING, State.RUNNING):
                self.state = State.STOPPING  # every trainer is at a step boundary, none is being recovered

    def _emit(self, event: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, event)(self, *args)

    def warn(self, message: str) -> None:
        self._emit("on_warning", message)

    # ------------------------------------------------------------------ states

    def _start(self) -> Step:
        try:
            self.shadow, self.group = self.parts.start()
            started = self.group.start()
        except RunFailedError:  # an actor Ray could not start: its line says so
            raise
        except Exception as exc:  # the shadow or a trainer could not take its first state: one line, if it is ours
            if (cause := own_error(exc)) is None:
                raise
            if self.group is None and isinstance(cause, CorruptSnapshotError):  # nothing to resume: the input's
                raise JobConfigError(f"storage={self.job.storage!r} cannot be resumed: {cause}") from None
            who = "the trainers" if self.group is not None else "the shadow"
            return self._fail(Failure("drain_failed", self.step, f"{who} could not start: {cause}"))
        self.step = started.step
        self.monitor.shadow_incarnation = self._status().incarnation
        self._emit("on_start", started)
        # A resumed run with fewer steps left than the profile takes keeps the shadow's default interval.
        profiled = self.job.shadow.snapshot_interval is None \
            and self.job.steps - self.step >= profile_steps(self.job)
        return State.PROFILING if profiled else State.RUNNING

    def _profile(self) -> Step:
        try:
            report = startup_profile(self.job, self.shadow, self._train_all, first_step=self.step)
        except DrainFailedError as exc:  # the profile's snapshot could not be made durable
            return self._fail(Failure("drain_failed", self.step, f"the startup profile's snapshot could not be "
                                      f"made durable: {exc}"))
        except ShadowCallError as exc:  # the shadow's replay or snapshot raised while it was timed
            return self._fail(Failure("drain_failed", self.step, f"the startup profile failed in the shadow: {exc}"))
        self.step += report.training_steps
        if self.job.shadow.max_lag_steps is None and report.plan.lag_bound_steps:
            self.lag_bound = LagBound(max(1, int(report.plan.lag_bound_steps)),
                                      "the cost model's bound from the startup profile")
        self._emit("on_profile", report)
        return State.RUNNING

    def _train_all(self, step: int) -> TrainerProgress:
        results, failure = self.group.run(step, self.step)
        for progress in results.values():
            self.record.absorb(self, progress)
        self._note_dev()
        if failure is not None:
            raise RunFailedError(f"a trainer was lost during the startup profile ({failure.detail}); run again, or "
                                 "set shadow.snapshot_interval to skip the profile")
        return results[0]

    def _running(self) -> Step:
        job = self.job
        if self.step >= job.steps:
            return State.FINISHING
        self.group.start_standby()  # the run is steady: a no-op once started
        joined = self.group.grow(self.step)  # an elastic group takes back a rank Ray restarted
        if isinstance(joined, Failure):
            return self._fail(joined)
        self._report_group_changes()
        target = min(job.steps, (self.step // job.log_interval + 1) * job.log_interval)
        for callback in self.callbacks:
            target = callback.stop_at(self, self.step, target)
        began, start = time.perf_counter(), self.step
        results, failure = self.group.run(target, self.step)  # poll
        for progress in results.values():
            self.record.absorb(self, progress)
        self._report_group_changes()
        if failure is not None:
            return self._fail(failure)
        progress = results[0]
        self.step = progress.step
        self._note_dev()
        metrics = self._metrics(self.group.trainer_times())
        failure = self.monitor.check(self, metrics, progress)  # check
        if failure is not None:
            return self._fail(failure)
        if metrics.durable_log_step is not None:
            self.group.durable_next = metrics.durable_log_step + 1
        seconds = time.perf_counter() - began - progress.eval_seconds
        self._emit("on_segment", Segment(start, progress, results, metrics, seconds))
        return State.RUNNING

    def _report_group_changes(self) -> None:
        for change in self.group.changes[self._changes_reported:]:
            self._emit("on_group_change", change)
        self._changes_reported = len(self.group.changes)

    def _fail(self, failure: Failure) -> Step:
        for callback in self.callbacks:
            failure = callback.on_failure(self, failure)
        decision = decide(failure, self.job, self.budget, self.lag_bound)
        self._emit("on_decision", failure, decision)
        if decision.action is Action.RESTART:
            return Recovering(failure)
        if decision.action is Action.RESYNC:
            return Resyncing(decision.reason, self.lag_bound)
        return Failed(decision.reason, failure.step)

    def _recover(self, state: Recovering) -> Step:
        failure = state.failure
        restored = self.group.recover(failure)
        if isinstance(restored, Failure):  # a replacement was lost too: the policy decides again
            return self._fail(restored)
        info = restored.info
        self.step = info.step
        self._emit("on_recovery", Recovery(
            failed_at_step=failure.step, mode=failure.mode, recovered_step=info.step,
            seconds=time.perf_counter() - failure.seen_at, image_source=info.source, image_step=info.image_step,
            replayed_records=info.replayed_records, rank=restored.rank,
            cause="records_lost" if failure.kind == "records_lost" else "trainer_lost",
            replaced_by=restored.replaced_by, state_hash=info.state_hash, preinstalled=info.preinstalled,
            copy_threads=info.copy_threads, read_through=info.read_through, replay_threads=info.replay_threads,
            phases=restored.phases))
        return State.RUNNING  # a host failure restarted the shadow too: the next check counts it

    def _resync(self, state: Resyncing) -> Step:
        step = self.group.export_to_shadow(self.step)  # rank 0 writes its state into the shadow's intake
        if isinstance(step, Failure):
            self.shadow.abort_intake()  # the shadow snapshots its replica again
            return self._fail(step)
        self.shadow.resync(step)
        self.group.resynced(step)
        self._emit("on_resync", step, state.reason, self._status().lag_steps)
        return State.RUNNING

    def _finish(self) -> Step:
        end = self._make_durable()
        if isinstance(end, Failure):
            return self._fail(end)
        hashes, metrics = end
        final_step, final_hash = hashes[0]
        _, shadow_hash = self.shadow.replica_hash()
        self._check_profile(metrics)
        # A run resumed at its last step trained nothing: its trainer says which kernels it would use.
        kernel = self.record.last.kernel if self.record.last is not None else self.group.kernel()
        if kernel.check is not None and kernel.check.passed is False:
            self.warn(f"the GPU kernels differed from the CPU oracle at start-up: the trainer ran the eager path "
                      f"({kernel.check})")
        self.summary = self.record.summarize(self, final_step, final_hash, shadow_hash, metrics,
                                             [h for _, h in hashes], self.group.resent_records(), kernel)
        return State.DONE

    def _make_durable(self) -> tuple[list[tuple[int, str]], ShadowMetrics] | Failure:
        """Every rank's final (step, state_hash) and the shadow's metrics once that state is durable; records the
        shadow still lacks after delivery are lost (`records_lost`)."""
        for _ in range(DRAIN_ATTEMPTS):
            incarnation = self._status().incarnation  # waits while Ray restarts the shadow
            try:
                expected = self.group.deliver(self.step)
            except ShadowRestartedError:  # the shadow went away under the delivery: ask again
                continue
            if isinstance(expected, Failure):
                return expected
            hashes = self.group.state_hashes(self.step)
            if isinstance(hashes, Failure):
                return hashes
            step = hashes[0][0]
            if expected < step:
                return Failure("records_lost", step, f"the shadow holds the records up to step {expected}, the "
                                                     f"trainers are at step {step}, and no process holds the "
                                                     f"records of steps {expected}..{step - 1}")
            try:
                return hashes, self.shadow.drain(step, DRAIN_SECONDS, incarnation)
            except ShadowRestartedError:
                continue
            except DrainFailedError as exc:
                return Failure("drain_failed", step, f"the final state could not be made durable: {exc}")
        return Failure("drain_failed", self.step, f"the final state could not be made durable: the shadow restarted "
                                                  f"{DRAIN_ATTEMPTS} times while it was handed the final records")

    def _stopping(self) -> Step:
        """Make durable what the shadow holds; the trainers are at a step boundary."""
        url, name = self.job.run_url, signal_name(self.stop.signum)
        try:
            self.group.deliver(self.step)  # every record a trainer holds, to the shadow
        except ShadowRestartedError:
            pass  # the shadow was lost meanwhile: what it holds is what there is (as where a trainer was lost)
        status = self._status()
        step = status.received_step
        try:
            self.shadow.drain(step, DRAIN_SECONDS, status.incarnation)
            self.stopped = f"stopped by {name} at step {step}: its state is durable in {url}"
        except (DrainFailedError, ShadowRestartedError) as exc:
            durable = self._status().durable_step
            self.stopped = (f"stopped by {name} at step {self.step}: the state there could not be made durable "
                            f"({exc}); the durable state of step {durable} in {url} resumes the run")
        return State.STOPPED

    # ------------------------------------------------------------------ helpers

    def _check_profile(self, metrics: ShadowMetrics) -> None:
        """Warn where the startup profile's timings are far off the run's steady state."""
        for name, (profiled, steady) in self.record.profile_pairs(metrics).items():
            ratio = steady / profiled
            if not 1 / PROFILE_TOLERANCE <= ratio <= PROFILE_TOLERANCE:
                self.warn(f"the startup profile's {name.replace('_', ' ')} ({profiled * 1e3:.2f} ms) is "
                          f"{ratio:.2f}x off the run's steady state ({steady * 1e3:.2f} ms)")

    def _metrics(self, times: TrainerTimes | None = None) -> ShadowMetrics:
        """The status and the stats, once a segment (its callbacks report the stats)."""
        try:
            return self.shadow.metrics(times)
        except ShadowGoneError as exc:
            raise _ShadowGone(Failure("shadow_gone", self.step, str(exc))) from exc

    def _note_dev(self) -> None:
        """With dev rows: tell the shadow every dev loss so far (it pins the best step's snapshot, releases the
        others), again after it restarted."""
        evaluations = self.record.evaluations
        if self.job.task.num_dev is None or not evaluations:
            return
        losses = {step: m["dev_loss"] for step, m in evaluations.items() if "dev_loss" in m}
        told = (len(losses), max(evaluations), self.monitor.shadow_incarnation)
        if told == self._dev_told:
            return
        try:
            self.shadow.note_dev(losses, max(evaluations))
        except ShadowGoneError as exc:
            raise _ShadowGone(Failure("shadow_gone", self.step, str(exc))) from exc
        self._dev_told = told

    def _status(self) -> ShadowStatus:
        try:
            return self.shadow.status()
        except ShadowGoneError as exc:
            raise _ShadowGone(Failure("shadow_gone", self.step, str(exc))) from exc

    def _stop_actors(self, graceful: bool = True) -> bool:
        """End every process of the run, the shadow first sealing its log and releasing the lease (`graceful`),
        else released here once it is dead, so a rerun takes it at once; returns whether it was released."""
        released = False
        try:
            if graceful:
                released = self._close_shadow()
        except RunStopped as now:  # a second signal: no more waiting, but nothing is left running
            graceful, self.state, self.stopped = False, State.STOPPED, str(now)
        gone = self.parts.stop()  # nothing of the run is left once this returns: a rerun finds its names free
        if graceful and not released and self.shadow is not None and self.writer is not None and gone:
            try:
                released = release_dead_holder(self.job.run_url, self.job.storage_options, owner=self.writer,
                                               lease_seconds=self.job.durability.lease_seconds)
            except (StorageError, LeaseError) as exc:
                self.warn(f"the run's lease could not be released (it goes stale in "
                          f"{self.job.durability.lease_seconds:g} s): "
                          f"{exc}")
        return released

    def _close_shadow(self) -> bool:
        if self.shadow is None:
            return False
        released, problem = self.shadow.close(CLOSE_SECONDS)
        if problem:
            self.warn(problem)
        return released


class _ShadowGone(Exception):
    """The shadow is gone for good: carries the failure to the state loop."""

    def __init__(self, failure: Failure):
        super().__init__(failure.detail)
        self.failure = failure


