"""Faults that tests, benchmarks and the demonstration inject on purpose.

They are not part of a user's `JobConfig`: `zocheck_ray.run(job, faults=...)` and the
CLI's `--fail-at` / `--fail-mode` pass them to the actors beside the job.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class FaultInjection(BaseModel):
    """Faults injected into the trainer and the shadow."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replay_delay_seconds: float = Field(0.0, ge=0)
    """Extra seconds the shadow spends per replayed step (makes it lag)."""
    replay_stalled: bool = False
    """The shadow's replay applies no record: only resyncs move its replica (a shadow that falls behind
    however slow the trainer is)."""
    crash_in_recovery_marker: str | None = None
    """A file path: the first recovering trainer that finds it missing creates it and dies mid-recovery."""


NO_FAULTS = FaultInjection()
