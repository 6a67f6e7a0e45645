"""What happens after a failure: the failures a run meets, and one table that decides.

`decide` is pure and the one place where a failure becomes what happens next, so a new
failure mode is a new row here, not a branch elsewhere.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

from zocheck_ray.config import JobConfig

FailureKind = Literal["trainer_lost", "trainer_gone", "shadow_gone", "shadow_lag", "replay_error", "records_lost",
                      "durability_stalled", "writer_lost", "drain_failed", "storage_lost", "storage_refused",
                      "input_refused"]


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    step: int
    """The last step boundary every trainer had reached."""
    detail: str
    mode: Literal["software", "host", "unplanned"] = "unplanned"
    """For a lost trainer: `software` or `host` when injected, else `unplanned`."""
    ranks: tuple[int, ...] = ()
    """The ranks whose processes were lost; empty for a torn collective or `records_lost`."""
    seen_at: float = field(default_factory=time.perf_counter, compare=False)
    """When the controller saw it; a recovery's seconds count from here."""


DEFAULT_MAX_LAG_STEPS = 64
"""Resync bound when the job sets none and the startup profile gives none."""


@dataclass(frozen=True)
class LagBound:
    """How many steps the shadow may lag before a resync, and who set it: the run's controller owns it."""

    steps: int
    source: str

    @classmethod
    def of_job(cls, job: JobConfig) -> "LagBound":
        """The job's `shadow.max_lag_steps`, else the default until the startup profile gives the cost model's."""
        if job.shadow.max_lag_steps is not None:
            return cls(job.shadow.max_lag_steps, "shadow.max_lag_steps")
        return cls(DEFAULT_MAX_LAG_STEPS, "the default: set shadow.max_lag_steps, or failure.mtbf_hours for the "
                                          "cost model's")


class Action(enum.Enum):
    RESTART = "restart"    # replace the lost trainers (the standby, or Ray's restart) and restore them
    RESYNC = "resync"      # copy the trainer's state into the shadow
    FAIL = "fail"          # end the run with a clear error


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


@dataclass
class FailureBudget:
    """How many lost trainers a run survives: `failure.max_restarts`, as Ray restarts a process."""

    limit: int
    spent: int = 0

    def spend(self) -> bool:
        """Count one more; False once the budget is exceeded."""
        self.spent += 1
        return self.spent <= self.limit


FATAL: dict[str, Callable[[Failure, JobConfig], str]] = {
    "durability_stalled": lambda f, job: f"{f.detail}; the run stops rather than go on without durability: fix the "
                                         f"storage at {job.run_url} and run the same job again to resume",
    "storage_lost": lambda f, job: f"{f.detail}: the run stops rather than write on and report durable what a "
                                   f"recovery could not read; run the same job again to resume from what is left in "
                                   f"{job.run_url} (the trainer recomputes the steps lost), or restore it first",
    "storage_refused": lambda f, job: f"{f.detail}; the run stops rather than wait on writes that cannot succeed: "
                                      f"make {job.run_url} writable and run the same job again to resume",
    "writer_lost": lambda f, job: f"{f.detail}; one writer per run: stop the other writer or give this job another "
                                  "run_id or storage",
    "input_refused": lambda f, job: f"{f.detail}; a restart would meet it again: fix it, and run the same job again "
                                    "to resume from the durable state",
    "trainer_gone": lambda f, job: f"the trainer cannot be restarted ({f.detail}); raise failure.max_restarts (now "
                                   f"{job.failure.max_restarts}) or look at the trainer's log",
    "shadow_gone": lambda f, job: f"the shadow cannot be restarted ({f.detail}); the durable state under "
                                  f"{job.run_url} resumes the run",
}
"""The failures that end the run, each with the line that says why and what to do."""


def decide(failure: Failure, job: JobConfig, budget: FailureBudget, lag: LagBound | None = None) -> Decision:
    """The one place where a failure becomes what happens next; `lag`: the run's lag bound (the job's without)."""
    kind = failure.kind
    if kind == "trainer_lost":
        if not budget.spend():
            return Decision(Action.FAIL, f"trainers were lost {budget.spent} times, more than failure.max_restarts="
                                         f"{job.failure.max_restarts}: raise it, or look at the trainers' logs")
        lost = f"rank {', '.join(map(str, failure.ranks))}" if failure.ranks else "no process (a torn collective)"
        return Decision(Action.RESTART, f"lost {lost}: the lost ranks are replaced (by the standby, or by Ray's "
                                        "restart of their process) and every rank restores at the shadow's step")
    if kind == "records_lost":  # a host failure in two steps: a trainer, then the shadow (or the other way)
        return Decision(Action.RESTART, f"{failure.detail}: the trainer and the shadow were lost one after the "
                                        "other before those records were durable; every rank restores from the "
                                        "shadow's durable image and trains the lost steps again")
    if kind == "shadow_lag":
        lag = lag or LagBound.of_job(job)
        return Decision(Action.RESYNC, f"the shadow lags more than {lag.steps} steps ({lag.source})")
    if kind == "replay_error":
        return Decision(Action.RESYNC, "the shadow's replay stopped")
    return Decision(Action.FAIL, FATAL[kind](failure, job) if kind in FATAL else failure.detail)
