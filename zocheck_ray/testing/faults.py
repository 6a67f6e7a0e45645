"""Faults injected on purpose, by tests, benchmarks and the demonstration (`--fail-at`).

They reach a run through its seams, never through a user's `JobConfig` or `zocheck_ray.run`:
`FaultInjection` travels with the trainer and shadow processes (`runtime/hooks.py`) and remembers
in marker files what it already did; `FailAt` is a `RunCallback` that kills processes at a
segment's end and names the failures it caused when the controller sees them.

    summary = run_with_faults(job, fail_at=[40], fail_mode="software")
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from typing import Callable, Literal

import ray

from zocheck_ray.config import JobConfig, JobConfigError
from zocheck_ray.control.callbacks import RunCallback
from zocheck_ray.control.launch import launch
from zocheck_ray.control.profile import profile_steps
from zocheck_ray.control.policy import Failure
from zocheck_ray.control.summary import RunSummary
from zocheck_ray.testing.injection import NO_FAULTS, FaultInjection

FailMode = Literal["software", "host", "shadow"]

INJECTED = {
    "software": "the trainer process exits (Ray prints it as '(raylet) A worker died or was killed ...')",
    "host": "the trainer and the shadow lose their processes and in-memory images, as with a lost node",
    "shadow": "the shadow process is killed; Ray restarts it from durable storage",
}


class FailAt(RunCallback):
    """Fails the run at `steps` (`mode`): software failures die by themselves (`FaultInjection.die_at`);
    host and shadow failures are dealt at the end of a segment cut at the step."""

    def __init__(self, steps: list[int], mode: FailMode, rank: int = 0, kill_node: Callable[[], None] | None = None,
                 say: Callable[[str], None] = lambda line: None):
        self.pending, self.mode, self.rank, self.kill_node, self.say = sorted(steps), mode, rank, kill_node, say
        self.dealt: int | None = None
        """The step of a failure dealt and not yet seen by the controller."""

    def stop_at(self, run, step, target):
        if not self.pending or not step <= self.pending[0] < target:
            return target
        if self.mode != "software":
            return self.pending[0]  # dealt at the segment's end (`on_segment`)
        self.dealt = self.pending.pop(0)
        who = f"rank {self.rank}'s process exits" if run.job.scaling.trainers > 1 else INJECTED["software"]
        self.say(f"  injected failure at step {self.dealt}: {who}")
        return self.dealt + 1  # the process exits before running that step, in this segment

    def on_segment(self, run, segment):
        if self.mode == "software" or not self.pending or segment.progress.step != self.pending[0]:
            return
        step = self.pending.pop(0)
        self.say(f"  injected failure at step {step}: {INJECTED[self.mode]}")
        if self.mode == "shadow":  # Ray restarts it from durable storage; the run goes on
            run.shadow.kill()
            return
        self.dealt = step
        if self.kill_node is not None:
            self.kill_node()
        else:  # a cluster whose nodes cannot be removed: both processes die, with the shadow's images
            run.shadow.kill()
            ray.kill(run.group.leader, no_restart=False)

    def on_failure(self, run, failure: Failure) -> Failure:
        if failure.kind != "trainer_lost" or self.dealt is None:
            return failure
        step, self.dealt = self.dealt, None
        return dataclasses.replace(failure, step=step, mode=self.mode)


class InjectedTrialFailure(RuntimeError):
    """Raised on purpose by `FailTrialOnce`."""


class FailTrialOnce(RunCallback):
    """Raises `InjectedTrialFailure` at the first segment that reaches `step` in a run whose job `matches`, once
    across processes (a file under `marker_dir` remembers it): a Tune trial that fails and is restored."""

    def __init__(self, step: int, marker_dir: str, matches: Callable[[JobConfig], bool] = lambda job: True):
        self.step, self.marker_dir, self.matches = step, marker_dir, matches

    def on_segment(self, run, segment):
        if segment.progress.step < self.step or not self.matches(run.job):
            return
        marker = os.path.join(self.marker_dir, f"failed-{run.job.run_id}")
        if not os.path.exists(marker):
            open(marker, "w").close()
            raise InjectedTrialFailure(f"injected trial failure at step {segment.progress.step}")


def run_with_faults(job: JobConfig, fail_at: list[int] | None = None, fail_mode: FailMode = "software",
                    progress: Callable[[str], None] | None = print, kill_node: Callable[[], None] | None = None,
                    faults: FaultInjection | None = None, fail_rank: int = 0, callbacks=(), on_segment=None,
                    placement_group=None, first_bundle: int = 0) -> RunSummary:
    """`zocheck_ray.run` with failures: at the steps `fail_at`, `software` kills the trainer process (of
    rank `fail_rank` with `trainers > 1`), `host` both the trainer and the shadow (`kill_node`: remove their
    node instead), `shadow` the shadow. `faults`: more to inject (a slow replay, a death mid-recovery)."""
    failures = _checked(job, fail_at, fail_mode, fail_rank)
    faults = faults or NO_FAULTS
    markers = None
    if failures and fail_mode == "software":
        # where each rank notes the failures it has been dealt, so that its restarted process does not die
        # again at the same step; the run's own, removed when it ends
        markers = tempfile.mkdtemp(prefix="zocheck-faults-")
        faults = faults.model_copy(update={"die_at": {fail_rank: failures}, "marker_dir": markers})
    say = progress or (lambda line: None)
    injector = [FailAt(failures, fail_mode, fail_rank, kill_node, say)] if failures else []
    try:
        return launch(job, progress, [*injector, *callbacks], on_segment, placement_group, first_bundle,
                      hooks=faults if faults != NO_FAULTS else None)
    finally:
        if markers is not None:
            shutil.rmtree(markers, ignore_errors=True)


def check_failures(job: JobConfig, fail_at: list[int] | None, fail_mode: str = "software", fail_rank: int = 0
                   ) -> list[int]:
    """The failures `run_with_faults` injects, checked: `JobConfigError` naming the flag, before anything runs."""
    return _checked(job, fail_at, fail_mode, fail_rank)


def _checked(job: JobConfig, fail_at: list[int] | None, fail_mode: str, fail_rank: int) -> list[int]:
    if fail_mode not in INJECTED:
        raise JobConfigError(f"fail_mode must be software, host or shadow, got {fail_mode!r}")
    if not 0 <= fail_rank < job.scaling.trainers:
        raise JobConfigError(f"fail_rank={fail_rank} is not a rank of scaling.trainers={job.scaling.trainers} "
                             f"(0..{job.scaling.trainers - 1})")
    if job.scaling.trainers > 1 and fail_at and fail_mode != "software":
        raise JobConfigError(f"fail_mode={fail_mode} with scaling.trainers={job.scaling.trainers}: only software "
                             "failures (one "
                             "rank's process, --fail-rank) are injected into data-parallel runs")
    failures = sorted(set(fail_at or []))
    if any(not 0 < f < job.steps for f in failures):
        raise JobConfigError(f"fail_at steps must lie in (0, {job.steps}), got {failures}")
    if job.shadow.snapshot_interval is None and failures:
        if failures[0] <= profile_steps(job):
            raise JobConfigError(f"fail_at step {failures[0]} falls in the startup profile (its first "
                                 f"{profile_steps(job)} steps); fail later or set shadow.snapshot_interval")
    return failures
