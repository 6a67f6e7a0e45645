"""Failures a run deals itself on purpose: a typed plan that `zocheck_ray.run` accepts.

    run(job, faults=FaultPlan(steps=(40,), mode="host"))
    run(job, faults=FaultPlan(schedule=((20, "software"), (40, "host"))))
    run(job, faults=FaultPlan(fraction=0.6))       # the embedded default's: once, at 60% of the run

`check` refuses a plan that cannot fire, before anything runs; `place` puts it after the run's
resume point and startup profile; `FaultInjector` deals it.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from typing import Callable, Literal, Protocol

from zocheck_ray.config import JobConfig, JobConfigError
from zocheck_ray.control.callbacks import RunCallback
from zocheck_ray.control.policy import Failure
from zocheck_ray.control.profile import profile_steps
from zocheck_ray.runtime.injection import NO_FAULTS, FaultInjection

FailMode = Literal["software", "host", "shadow"]

INJECTED = {
    "software": "the trainer process exits (Ray prints it as '(raylet) A worker died or was killed ...')",
    "host": "the trainer and the shadow lose their processes and in-memory images, as with a lost node",
    "shadow": "the shadow process is killed; Ray restarts it from durable storage",
}
WHAT = {"software": "trainer", "host": "host", "shadow": "shadow"}


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    """Which failures a run deals itself, and where."""

    steps: tuple[int, ...] = ()
    """Steps at which a failure is dealt (before the step runs)."""
    mode: FailMode = "software"
    """`software`: the trainer process exits; `host`: the trainer and the shadow lose their processes and images;
    `shadow`: the shadow process is killed."""
    rank: int = 0
    """With `scaling.trainers > 1`: the rank whose process exits (software failures only)."""
    fraction: float | None = None
    """Instead of `steps`: one failure at this fraction of the run's steps (none where no step is left)."""
    schedule: tuple[tuple[int, FailMode], ...] = ()
    """Failures of their own modes, beside `steps`: (step, mode) pairs."""
    injection: FaultInjection = NO_FAULTS
    """More faults the processes inject into themselves (a slow replay, a death mid-recovery)."""
    kill_node: Callable[[], None] | None = None
    """Host failures: remove the node (a multi-node test cluster) instead of killing the two processes."""

    def failures(self) -> list[tuple[int, FailMode]]:
        """(step, mode) of every failure `steps` and `schedule` name, by step."""
        return sorted({*((s, self.mode) for s in self.steps), *self.schedule})

    def check(self, job: JobConfig) -> None:
        """Refuse a plan that cannot fire in `job` (`JobConfigError` naming the setting), before anything runs."""
        for mode in {self.mode, *(m for _, m in self.schedule)}:
            if mode not in INJECTED:
                raise JobConfigError(f"fail_mode must be software, host or shadow, got {mode!r}")
        if not 0 <= self.rank < job.scaling.trainers:
            raise JobConfigError(f"fail_rank={self.rank} is not a rank of scaling.trainers={job.scaling.trainers} "
                                 f"(0..{job.scaling.trainers - 1})")
        modes = {m for _, m in self.failures()} | ({self.mode} if self.fraction else set())
        if job.scaling.trainers > 1 and modes - {"software"}:
            raise JobConfigError(f"fail_mode={sorted(modes - {'software'})[0]} with scaling.trainers="
                                 f"{job.scaling.trainers}: only software failures (one rank's process, --fail-rank) "
                                 "are injected into data-parallel runs")
        if self.fraction is not None and not 0 < self.fraction < 1:
            raise JobConfigError(f"a fault plan's fraction must lie in (0, 1), got {self.fraction}")
        steps = sorted({s for s, _ in self.failures()})
        if any(not 0 < f < job.steps for f in steps):
            raise JobConfigError(f"fail_at steps must lie in (0, {job.steps}), got {steps}")
        if steps and job.shadow.snapshot_interval is None and steps[0] <= profile_steps(job):
            raise JobConfigError(f"fail_at step {steps[0]} falls in the startup profile (its first "
                                 f"{profile_steps(job)} steps); fail later or set shadow.snapshot_interval")

    def place(self, job: JobConfig, resume_step: int | None, say: Callable[[str], None]) -> PlacedFaults:
        """The steps this plan fails at in a run of `job` resuming at `resume_step` (None: fresh)."""
        self.check(job)
        failures = self.failures()
        start = resume_step or 0
        if self.fraction is not None:
            first_allowed = start + (1 if job.shadow.snapshot_interval else profile_steps(job) + 1)
            step = max(round(self.fraction * job.steps), first_allowed)
            failures = [(step, self.mode)] if step < job.steps else []
            if not failures:
                say(f"  no injected {WHAT[self.mode]} failure (no step after the startup profile is left for one)")
        for step, mode in failures:
            say(f"  injected {WHAT[mode]} failure at step {step}")
        if failures and failures[0][0] <= start:
            say(f"  note: the run resumes at step {start}, so the failure at step {failures[0][0]} does not fire")
        markers = None
        hooks = self.injection
        if exits := [step for step, mode in failures if mode == "software"]:
            # where the rank notes the failures it was dealt, so that its restarted process does not die again at
            # the same step; the run's own, removed when it ends (`PlacedFaults.close`)
            markers = tempfile.mkdtemp(prefix="zocheck-faults-")
            hooks = hooks.model_copy(update={"die_at": {self.rank: exits}, "marker_dir": markers})
        return PlacedFaults(self, tuple(failures), None if hooks == NO_FAULTS else hooks, markers)


@dataclasses.dataclass(frozen=True)
class PlacedFaults:
    """A plan placed in a run: its steps, and what its processes inject into themselves."""

    plan: FaultPlan
    failures: tuple[tuple[int, FailMode], ...]
    """(step, mode), by step."""
    hooks: FaultInjection | None
    """Handed to every trainer and shadow process (None: nothing)."""
    marker_dir: str | None

    def injector(self, processes: Processes, say: Callable[[str], None]) -> FaultInjector | None:
        return FaultInjector(self, processes, say) if self.failures else None

    def close(self) -> None:
        if self.marker_dir is not None:
            shutil.rmtree(self.marker_dir, ignore_errors=True)


class Processes(Protocol):
    """The handles a fault injector kills through (the run's placement)."""

    def kill_shadow(self) -> None:
        """Kill the shadow's process; Ray restarts it from durable storage."""

    def kill_trainer(self, rank: int) -> None:
        """Kill rank `rank`'s process; Ray restarts it."""


class FaultInjector(RunCallback):
    """Deals a placed plan: software failures die by themselves (`FaultInjection.die_at`); host and shadow
    failures at the end of a segment cut at the step, through the placement's process handles."""

    def __init__(self, placed: PlacedFaults, processes: Processes, say: Callable[[str], None]):
        self.pending, self.plan = list(placed.failures), placed.plan
        self.processes, self.say = processes, say
        self.dealt: tuple[int, FailMode] | None = None
        """A failure dealt and not yet seen by the controller."""

    def stop_at(self, run, step, target):
        if not self.pending or not step <= self.pending[0][0] < target:
            return target
        if self.pending[0][1] != "software":
            return self.pending[0][0]  # dealt at the segment's end (`on_segment`)
        self.dealt = self.pending.pop(0)
        who = f"rank {self.plan.rank}'s process exits" if run.job.scaling.trainers > 1 else INJECTED["software"]
        self.say(f"  injected failure at step {self.dealt[0]}: {who}")
        return self.dealt[0] + 1  # the process exits before running that step, in this segment

    def on_segment(self, run, segment):
        if not self.pending or self.pending[0][1] == "software" or segment.progress.step != self.pending[0][0]:
            return
        step, mode = self.pending.pop(0)
        self.say(f"  injected failure at step {step}: {INJECTED[mode]}")
        if mode == "shadow":  # Ray restarts it from durable storage; the run goes on
            self.processes.kill_shadow()
            return
        self.dealt = step, mode
        if self.plan.kill_node is not None:
            self.plan.kill_node()
        else:  # a cluster whose nodes cannot be removed: both processes die, with the shadow's images
            self.processes.kill_shadow()
            self.processes.kill_trainer(0)

    def on_failure(self, run, failure: Failure) -> Failure:
        if failure.kind != "trainer_lost" or self.dealt is None:
            return failure
        (step, mode), self.dealt = self.dealt, None
        return dataclasses.replace(failure, step=step, mode=mode)
