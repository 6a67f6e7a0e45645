"""`zocheck_ray.run`: the start-up check, then the run's actors placed on Ray and driven by the controller."""

from __future__ import annotations

from typing import Callable, Iterable

from ray.util.placement_group import PlacementGroup

from zocheck_ray.actors.shadow_actor import shadow_writer
from zocheck_ray.config import JobConfig, with_absolute_paths
from zocheck_ray.control.callbacks import ProgressPrinter, RunCallback, SegmentFunction
from zocheck_ray.control.controller import Controller
from zocheck_ray.control.faults import FaultPlan
from zocheck_ray.control.placement import Placement
from zocheck_ray.control.startup import check_run
from zocheck_ray.control.stop import StopRequest
from zocheck_ray.control.summary import RunSummary
from zocheck_ray.runtime.messages import ShadowMetrics, TrainerProgress
from zocheck_ray.workload.custom import Workload


def run(job: JobConfig, progress: Callable[[str], None] | None = print, callbacks: Iterable[RunCallback] = (),
        on_segment: Callable[[TrainerProgress, ShadowMetrics], None] | None = None,
        placement_group: PlacementGroup | None = None, first_bundle: int = 0, faults: FaultPlan | None = None,
        address: str | None = None, workload: Workload | None = None) -> RunSummary:
    """Run `job` to completion on the Ray cluster of `address` (see `connect_ray`), resuming exactly a run whose
    storage holds a snapshot of `job.run_id`.

    `placement_group`: a reserved group (a Tune trial's) whose bundles from `first_bundle` on the actors use;
    `workload`: rows and functions handed over in Python. Raises `JobConfigError` before any actor starts,
    `RunFailedError`, or `RunStopped` after a stop signal; however it ends, no actor of the run is left.
    """
    job = with_absolute_paths(job)
    say = progress or (lambda line: None)
    after = [*callbacks, *([SegmentFunction(on_segment)] if on_segment else [])]
    with StopRequest().installed() as stop:
        startup = check_run(job, progress, placement_group, first_bundle, faults, address, workload)
        try:
            stop.install()  # again: connecting to Ray installed a SIGTERM handler of its own
            if stop.requested:
                stopped = stop.before_start()
                say(f"  {stopped}")
                raise stopped
            placement = Placement(job, startup, placement_group, first_bundle, say)
            injector = startup.faults.injector(placement, say) if startup.faults is not None else None
            chain = [ProgressPrinter(say), *([injector] if injector else []), *after]
            return Controller(job, startup.task, placement, chain, stop, writer=shadow_writer(job.run_id)).run()
        finally:
            if startup.faults is not None:
                startup.faults.close()
