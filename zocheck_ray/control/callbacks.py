"""What a run tells the world, as callbacks: the summary's record, the progress lines, Tune's
reports and the tests' injected faults. The controller calls every callback at each event, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from zocheck_ray.runtime.messages import KernelInfo, RecoveryInfo, ShadowMetrics, TrainerProgress
from zocheck_ray.config import JobConfig
from zocheck_ray.control.policy import Decision, Failure
from zocheck_ray.control.summary import Recovery, RunSummary, best_dev_step
from zocheck_ray.policies import ProfileReport


class Controller(Protocol):
    """What a callback sees of the run."""

    job: JobConfig
    task: object
    step: int
    """The step every trainer has reached."""
    group: object
    """The `TrainerGroup`."""
    shadow: object
    max_lag_steps: int
    monitor: object

    def warn(self, message: str) -> None: ...


@dataclass(frozen=True)
class Segment:
    """A segment of steps every rank ran, and the shadow's metrics after it."""

    start: int
    progress: TrainerProgress
    """Rank 0's report."""
    ranks: dict[int, TrainerProgress]
    """Every rank's report."""
    metrics: ShadowMetrics
    seconds: float
    """Wall time of the segment, evaluation excluded."""


class RunCallback:
    """Hooks into a run's events; override any (this base does nothing)."""

    def on_state(self, run: Controller, state: str) -> None:
        """The controller enters `state`."""

    def on_start(self, run: Controller, started: RecoveryInfo) -> None:
        """The actors are up; `started` is rank 0's first state."""

    def on_profile(self, run: Controller, report: ProfileReport) -> None:
        """The startup profile chose the snapshot interval and the replay threads."""

    def stop_at(self, run: Controller, step: int, target: int) -> int:
        """The step the next segment ends at; `target` unless a callback cuts it shorter."""
        return target

    def on_segment(self, run: Controller, segment: Segment) -> None:
        """A segment ended without a failure."""

    def on_failure(self, run: Controller, failure: Failure) -> Failure:
        """A failure was seen; a callback may return a more precise one before the policy decides."""
        return failure

    def on_decision(self, run: Controller, failure: Failure, decision: Decision) -> None:
        """What the failure policy decided."""

    def on_recovery(self, run: Controller, recovery: Recovery) -> None:
        """Lost trainers are back, every rank at the same step."""

    def on_resync(self, run: Controller, step: int, reason: str, lag_steps: int) -> None:
        """The shadow was reset from the trainer's state at `step`, because of `reason`."""

    def on_group_change(self, run: Controller, change) -> None:
        """An elastic group went on without a lost rank, or took one back (a `GroupChange`)."""

    def on_warning(self, run: Controller, message: str) -> None:
        """Something went wrong without ending the run."""

    def on_stopped(self, run: Controller, line: str) -> None:
        """A stop signal ended the run; `line` says where and what is durable."""


class ProgressPrinter(RunCallback):
    """The run's progress lines, through `say`."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say

    def on_start(self, run, started):
        job, task = run.job, run.task
        self.say(f"run {job.run_id}: {job.model} {job.dtype} {job.zo.optimizer}, {job.steps} steps, "
                 f"storage {job.run_url}")
        self.say(f"  task {task.config.kind}: {task.n_train} training rows, {task.n_eval} held-out rows "
                 f"({task.metric}), batch {task.config.batch_size}, {task.tokenizer.describe()}")
        for shortfall in task_warnings(task):
            self.say(f"  warning: {shortfall}")
        if job.scaling.trainers > 1:
            k, most = run.group.k, job.scaling.trainers
            count, waiting = (f"{k} of {most}", f"; waiting for room in the cluster for the other {most - k}") \
                if k < most else (f"{k}", "")
            self.say(f"  {count} data-parallel ranks ({job.scaling.placement}{waiting}), batch slices of "
                     f"{job.task.batch_size // job.scaling.trainers} rows, gloo process group formed")
        if started.source != "fresh":
            self.say(f"  resumed at step {started.step} from durable storage (its newest sound snapshot and the logged "
                     "records after it)" if started.source == "durable" else
                     f"  resumed from the {started.source} image at step {started.step}")

    def on_profile(self, run, report):
        t = report.timings
        self.say(f"  profile ({report.training_steps} steps, {report.profile_seconds:.1f} s): trainer step "
                 f"{t.gpu_step_seconds * 1e3:.1f} ms, replay {t.replay_step_seconds * 1e3:.2f} ms on "
                 f"{report.replay_threads} threads, snapshot {t.snapshot_cost_seconds * 1e3:.2f} ms, persist "
                 f"{t.persist_seconds * 1e3:.0f} ms: {report.plan.regime} regime, snapshot every "
                 f"{report.snapshot_interval} steps, resync beyond {run.max_lag_steps} steps of lag")

    def on_segment(self, run, segment):
        progress, m = segment.progress, segment.metrics
        metric = run.task.metric
        evaluated = max(progress.evaluations, default=None)
        held_out = (f"  held-out {metric} {progress.evaluations[evaluated][metric]:.4f}"
                    if evaluated is not None else "")
        self.say(f"  step {progress.step:5d}  loss {progress.loss:.4f}  lag {m.lag_steps:3d}  "
                 f"snapshot {_step_or_dash(m.snapshot_step)}  durable {_step_or_dash(m.durable_step)}{held_out}")
        for step, pairs in sorted(progress.samples.items()):
            for prompt, text in pairs:
                self.say(f"    generation at step {step}: {_tail(prompt)!r} -> {text!r}")

    def on_decision(self, run, failure, decision):
        if decision.action.value == "fail":
            self.say(f"  FAILED: {decision.reason}")

    def on_recovery(self, run, r):
        if r.cause == "records_lost":
            who = "every rank" if run.job.scaling.trainers > 1 else "the trainer"
            self.say(f"  the trainer and the shadow were lost one after the other before steps {r.recovered_step}.."
                     f"{r.failed_at_step - 1} were durable (a host failure in two steps): {who} restored at step "
                     f"{r.recovered_step} from the {r.image_source} image of step {r.image_step or 0} "
                     f"({r.replayed_records} records replayed) in {r.seconds:.2f} s and trains them again")
            return
        via = {"standby": "the standby took its place", "restart": "Ray restarted its process",
               "torn": "no process was lost"}[r.replaced_by]
        who = f"rank {r.rank}" if run.job.scaling.trainers > 1 else "trainer"
        self.say(f"  {who} lost at step {r.failed_at_step} ({r.mode}); {via}; recovered at step {r.recovered_step} "
                 f"from the {r.image_source} image of step {r.image_step or 0} ({r.replayed_records} records "
                 f"replayed) in {r.seconds:.2f} s")

    def on_stopped(self, run, line):
        self.say(f"  {line}")

    def on_group_change(self, run, c):
        verb = "go on" if c.kind == "shrink" else "train"
        plan = f", {c.plan_wait_seconds:.3f} s of it for the plan" if c.plan_wait_seconds is not None else ""
        self.say(f"  step {c.step}: {c.cause}; {c.ranks} ranks {verb} with shards {c.held} "
                 f"(the others waited {c.stall_seconds:.3f} s{plan})")

    def on_resync(self, run, step, reason, lag_steps):
        self.say(f"  {reason}: resynced from the trainer at step {step}")

    def on_warning(self, run, message):
        self.say(f"  warning: {message}")


@dataclass
class RunRecord(RunCallback):
    """What the `RunSummary` reports, recorded as the run goes."""

    states: list[str] = field(default_factory=list)
    losses: list[tuple[int, float]] = field(default_factory=list)
    step_hashes: dict[int, str] = field(default_factory=dict)
    evaluations: dict[int, dict[str, float]] = field(default_factory=dict)
    samples: dict[int, list[tuple[str, str]]] = field(default_factory=dict)
    eval_seconds: float = 0.0
    lag_samples: list[tuple[int, int]] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)
    resyncs: list[tuple[int, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    profile: ProfileReport | None = None
    resumed_from: int | None = None
    last: TrainerProgress | None = None
    steps_timed: int = 0
    seconds_timed: float = 0.0

    def on_state(self, run, state):
        self.states.append(state)

    def on_start(self, run, started):
        if started.source != "fresh":
            self.resumed_from = started.step
        self.warnings += [f"step {started.step}: {shortfall}" for shortfall in task_warnings(run.task)]

    def on_profile(self, run, report):
        self.profile = report

    def absorb(self, run, progress: TrainerProgress) -> None:
        """Record a rank's hashes and evaluations, warning where ranks' hashes of a step differ."""
        for step, digest in progress.step_hashes.items():
            seen = self.step_hashes.setdefault(step, digest)
            if seen != digest:
                run.warn(f"rank {progress.rank}'s state after step {step} differs from another rank's")
        self.evaluations.update(progress.evaluations)
        self.samples.update(progress.samples)
        self.eval_seconds += progress.eval_seconds

    def on_segment(self, run, segment):
        self.last = segment.progress
        self.losses.append((segment.progress.step, segment.progress.loss))
        self.lag_samples.append((segment.progress.step, segment.metrics.lag_steps))
        self.steps_timed += segment.progress.step - segment.start
        self.seconds_timed += segment.seconds

    def on_recovery(self, run, recovery):
        self.recoveries.append(recovery)
        if recovery.state_hash:
            self.step_hashes[recovery.recovered_step] = recovery.state_hash

    def on_resync(self, run, step, reason, lag_steps):
        self.resyncs.append((step, reason))
        self.lag_samples.append((run.step, lag_steps))

    def on_warning(self, run, message):
        self.warnings.append(f"step {run.step}: {message}")

    def profile_pairs(self, metrics: ShadowMetrics) -> dict[str, tuple[float, float]]:
        """(profiled, steady) seconds of the trainer and replay steps, where both are known."""
        if self.profile is None:
            return {}
        t = self.profile.timings
        pairs = {"trainer_step": (t.gpu_step_seconds, self.seconds_timed / max(self.steps_timed, 1)),
                 "replay_step": (t.replay_step_seconds, metrics.replay_seconds_per_step)}
        return {name: (p, s) for name, (p, s) in pairs.items() if p > 0 and s > 0}

    def summarize(self, run, final_step: int, final_hash: str, shadow_hash: str, metrics: ShadowMetrics,
                  rank_hashes: list[str], resent_records: int, kernel: KernelInfo | None = None) -> RunSummary:
        """The run's `RunSummary`, once its final state is durable."""
        job, task, times, ev = run.job, run.task, run.group.times, self.evaluations
        return RunSummary(
            run_id=job.run_id, steps=final_step, final_state_hash=final_hash, shadow_state_hash=shadow_hash,
            losses=self.losses, recoveries=self.recoveries, metrics=metrics,
            publish_us_median=self.last.publish_us_median if self.last else None,
            trainer_seconds_per_step=self.seconds_timed / max(self.steps_timed, 1),
            snapshot_interval=metrics.snapshot_interval, profile=self.profile, storage=job.run_url,
            step_hashes=self.step_hashes, lag_samples=self.lag_samples, resumed_from_step=self.resumed_from,
            task=task.summary(), metric=task.metric, evaluations=dict(sorted(ev.items())),
            samples=dict(sorted(self.samples.items())),
            metric_before=ev[min(ev)][task.metric] if ev else None,
            metric_after=ev[final_step][task.metric] if final_step in ev else None,
            best_dev_step=metrics.best_dev_step if metrics.best_dev_step is not None else best_dev_step(ev),
            best_dev_snapshot=metrics.best_dev_snapshot,
            eval_seconds=self.eval_seconds, shadow_restarts=run.monitor.shadow_restarts,
            resent_records=resent_records, resyncs=self.resyncs, warnings=self.warnings,
            states=self.states + ["done"], kernel=kernel or (self.last.kernel if self.last else None),
            trainers=job.scaling.trainers, group_changes=list(run.group.changes),
            profile_check={name: {"profiled_seconds": p, "steady_seconds": s, "ratio": s / p}
                           for name, (p, s) in self.profile_pairs(metrics).items()},
            rank_state_hashes=rank_hashes,
            rank_seconds_per_step=[s / max(n, 1) for s, n in zip(times.rank_seconds, times.rank_steps)],
            collective_seconds_per_step=times.collective_seconds / times.collective_steps
            if times.collective_steps else None)


class SegmentFunction(RunCallback):
    """`on_segment(progress, metrics)` as a callback."""

    def __init__(self, fn: Callable[[TrainerProgress, ShadowMetrics], None]):
        self.fn = fn

    def on_segment(self, run, segment):
        self.fn(segment.progress, segment.metrics)


def task_warnings(task) -> list[str]:
    """What the task's sampler was asked for beyond its rows (`workload.sampling.sample_with_shortfalls`); a task
    built otherwise (a `ZOTrainer`'s own rows) has none."""
    return list(getattr(task, "warnings", ()))


def _tail(prompt: str, chars: int = 60) -> str:
    """A prompt's end, where the generation goes on from it."""
    return prompt if len(prompt) <= chars else "..." + prompt[-chars:]


def _step_or_dash(step: int | None) -> str:
    """A step for a progress line, `-` before there is one."""
    return "-" if step is None else str(step)
