"""The driver: the controller's state machine, the failure policy, placement, start-up checks and
the callbacks through which a run reports."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zocheck_ray.core.lazy import on_first_use

if TYPE_CHECKING:
    from zocheck_ray.control.callbacks import RunCallback, Segment
    from zocheck_ray.control.controller import Controller, State
    from zocheck_ray.control.faults import FaultPlan
    from zocheck_ray.control.launch import run
    from zocheck_ray.control.policy import Action, Decision, Failure, FailureBudget, decide
    from zocheck_ray.control.stop import RunStopped
    from zocheck_ray.control.summary import Recovery, RunFailedError, RunSummary


__getattr__, __dir__ = on_first_use(globals(), {
    "callbacks": ("RunCallback", "Segment"),
    "controller": ("Controller", "State"),
    "faults": ("FaultPlan",),
    "launch": ("run",),
    "policy": ("Action", "Decision", "Failure", "FailureBudget", "decide"),
    "stop": ("RunStopped",),
    "summary": ("Recovery", "RunFailedError", "RunSummary"),
})
"""Names load with their modules on first use: importing the package loads no torch."""
