"""`zocheck_ray.run`: check the job, connect, place the run's actors on Ray and drive them with the controller."""

from __future__ import annotations

from typing import Callable, Iterable

from ray.util.placement_group import PlacementGroup

from zocheck_ray.actors.shadow_actor import shadow_writer
from zocheck_ray.config import JobConfig
from zocheck_ray.control.callbacks import ProgressPrinter, RunCallback, SegmentFunction
from zocheck_ray.control.controller import Controller
from zocheck_ray.control.placement import Placement
from zocheck_ray.control.startup import check_run
from zocheck_ray.control.stop import StopRequest
from zocheck_ray.control.summary import RunSummary
from zocheck_ray.runtime.messages import ShadowMetrics, TrainerProgress


def run(job: JobConfig, progress: Callable[[str], None] | None = print, callbacks: Iterable[RunCallback] = (),
        on_segment: Callable[[TrainerProgress, ShadowMetrics], None] | None = None,
        placement_group: PlacementGroup | None = None, first_bundle: int = 0) -> RunSummary:
    """Run `job` to completion on the connected Ray cluster (a local one is started if none).

    A run whose storage holds a snapshot of `job.run_id` resumes from it, exactly.
    `placement_group`: a reserved group (a Tune trial's) whose bundles from `first_bundle` on
    the actors use. `on_segment(progress, metrics)` is called after each segment; `callbacks`
    see every event. Raises `JobConfigError` before any actor starts, `RunFailedError`, or
    `RunStopped` after a stop signal. However it ends, no actor of the run is left.
    """
    return launch(job, progress, callbacks, on_segment, placement_group, first_bundle)


def launch(job: JobConfig, progress: Callable[[str], None] | None, callbacks: Iterable[RunCallback] = (),
           on_segment: Callable | None = None, placement_group: PlacementGroup | None = None,
           first_bundle: int = 0, hooks=None) -> RunSummary:
    """`run`, with `hooks` handed to the actors (how `zocheck_ray.testing` injects faults)."""
    say = progress or (lambda line: None)
    chain = [ProgressPrinter(say), *callbacks, *([SegmentFunction(on_segment)] if on_segment else [])]
    with StopRequest().installed() as stop:
        task, gpus = check_run(job, progress, placement_group, first_bundle)
        stop.install()  # again: connecting to Ray installed a SIGTERM handler of its own
        if stop.requested:
            stopped = stop.before_start()
            say(f"  {stopped}")
            raise stopped
        placement = Placement(job, gpus, placement_group, first_bundle, hooks, say)
        return Controller(job, task, placement, chain, stop, writer=shadow_writer(job.run_id)).run()
