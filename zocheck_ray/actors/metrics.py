"""`ShadowMetrics`: what the shadow reports about itself (also exported through ray.util.metrics)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class ShadowMetrics(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    """The run these metrics belong to."""
    trainer_step: int
    """Steps the trainer has published (the next step it will run)."""
    received_step: int
    """Records received and logged, in order (the next step expected)."""
    replayed_step: int
    """The replica is at this step (records applied)."""
    lag_steps: int
    """received_step - replayed_step."""
    lag_seconds: float
    """lag_steps times the replay time per step."""
    replay_seconds_per_step: float
    """Recent replay time per step (exponential moving average)."""
    snapshot_interval: int
    """N: steps between snapshots."""
    snapshot_step: int | None
    """Step of the newest in-memory image."""
    durable_step: int | None
    """Step of the newest committed durable snapshot."""
    durable_log_step: int | None
    """Last step whose record is durable in the step log."""
    persist_in_flight: bool
    """A snapshot write to durable storage is in progress (one at a time; newer images skip older ones)."""
    last_persist_seconds: float | None
    """Duration of the last completed snapshot write (log flush included)."""
    snapshots_taken: int
    """In-memory snapshots of the replica (one every N replayed steps)."""
    snapshots_persisted: int
    """Snapshots committed to durable storage."""
    resync_count: int
    """Times the shadow was reset from a copy of the trainer's state (lag above `max_lag_steps`)."""
    rejected_records: int
    """Records refused because they came from the past or the future."""
    regime: Literal["keep-pace", "lag", "unknown"]
    """The cost model's regime: `keep-pace` (replay faster than training), `lag` (slower), `unknown` (no profile)."""
    source: str
    """Where the replica came from: fresh, durable, resync."""
