"""The driver: the controller's state machine over a trainer group and its shadow, the failure policy,
placement and start-up checks, and the callbacks through which a run reports (see controller.py)."""

from zocheck_ray.control.callbacks import RunCallback, Segment
from zocheck_ray.control.controller import Controller, State, run
from zocheck_ray.control.policy import Action, Decision, Failure, FailureBudget, decide
from zocheck_ray.control.stop import RunStopped
from zocheck_ray.control.summary import Recovery, RunFailedError, RunSummary

__all__ = ["run", "Controller", "State", "RunCallback", "Segment", "Failure", "Action", "Decision", "FailureBudget",
           "decide", "Recovery", "RunSummary", "RunFailedError", "RunStopped"]
