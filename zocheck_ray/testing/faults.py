"""Faults injected on purpose by tests and benchmarks, on Ray: a `FaultPlan` (`control/faults.py`) given
to `zocheck_ray.run`, and a Tune trial that fails once.

    summary = run_with_faults(job, fail_at=[40], fail_mode="software")
"""

from __future__ import annotations

import os
from typing import Callable

from zocheck_ray.config import JobConfig
from zocheck_ray.control.callbacks import RunCallback
from zocheck_ray.control.faults import FailMode, FaultPlan
from zocheck_ray.control.launch import run
from zocheck_ray.control.summary import RunSummary
from zocheck_ray.runtime.injection import NO_FAULTS, FaultInjection


class InjectedTrialFailure(RuntimeError):
    """Raised on purpose by `FailTrialOnce`."""


class FailTrialOnce(RunCallback):
    """Raises `InjectedTrialFailure` at the first segment that reaches `step` in a run whose job `matches`, once
    across processes: a Tune trial that fails and is restored."""

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
    """`zocheck_ray.run` with failures of `fail_mode` at the steps `fail_at` (`FaultPlan`'s modes; `kill_node`:
    remove the node instead); `faults`: more to inject."""
    plan = FaultPlan(steps=tuple(fail_at or ()), mode=fail_mode, rank=fail_rank, injection=faults or NO_FAULTS,
                     kill_node=kill_node)
    return run(job, progress, callbacks, on_segment, placement_group, first_bundle, faults=plan)
