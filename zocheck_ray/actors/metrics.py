"""`ShadowMetrics`: what the shadow reports about itself (also exported through ray.util.metrics)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class ShadowMetrics(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    """The run these metrics belong to."""
    incarnation: str
    """Which shadow process answers (a new one after Ray restarts the shadow)."""
    trainer_step: int
    """The trainer's step (the next step it will run), as the trainer last reported it."""
    received_step: int
    """Records accepted, in order (the next step expected)."""
    replayed_step: int
    """The replica is at this step (records applied)."""
    lag_steps: int
    """trainer_step - replayed_step: how far the replica is behind the trainer."""
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
    undurable_steps: int
    """trainer_step minus the steps durable in the log: what a lost node would have to recompute."""
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
    persist_failures: int
    """Failed attempts to write the log or a snapshot (each retried with backoff)."""
    persist_failing_seconds: float
    """How long persistence has been failing without a success (0 when it works)."""
    persist_stopped: bool = False
    """Persistence stopped for good: another writer took over the run's storage (see `persist_error`)."""
    ingest_error: str | None = None
    """The last error of the ingest stage (a damaged push)."""
    replay_error: str | None = None
    """The replay stage's error: it stopped, and only a resync from the trainer repairs the replica."""
    persist_error: str | None = None
    """The last error of the persistence stage (cleared by the next success)."""
    rank_seconds_per_step: list[float] = []
    """Each trainer rank's mean step time over the controller's last segment (one entry with one
    trainer; empty until the first segment). Exported as one gauge tagged by `rank`."""
    collective_seconds_per_step: float | None = None
    """Data parallel: the ranks' all-gather per step over the last segment, waits for the slowest rank included."""
    regime: Literal["keep-pace", "lag", "unknown"]
    """The cost model's regime: `keep-pace` (replay faster than training), `lag` (slower), `unknown` (no profile)."""
    source: str
    """Where the replica came from: fresh, durable, resync."""


def numeric_fields(metrics: ShadowMetrics) -> dict[str, float]:
    """Every numeric field (booleans as 0/1; unset ones left out): what the Prometheus gauges export."""
    out = {}
    for name, value in metrics.model_dump().items():
        if isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)):
            out[name] = float(value)
    return out
