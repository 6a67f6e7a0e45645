"""`FaultInjection`: the faults a run's trainer and shadow processes inject into themselves
(`runtime/hooks.py`'s seams): a fault plan's exits (`control/faults.py`) and the tests' stalls.

It travels as a constructor argument, so a restarted process unpickles it first, and imports
nothing but pydantic, to keep heavy imports out of a standby promotion's window.
"""

from __future__ import annotations

import os
import time

from pydantic import BaseModel, ConfigDict, Field


class FaultInjection(BaseModel):
    """Faults injected into the trainer and shadow processes (implements `runtime.hooks`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replay_delay_seconds: float = Field(0.0, ge=0)
    """Extra seconds the shadow spends per replayed step (makes it lag)."""
    replay_stalled: bool = False
    """The shadow's replay applies no record, so only resyncs move its replica."""
    crash_in_recovery_marker: str | None = None
    """A path: the first recovering trainer that finds it missing creates it and dies mid-recovery."""
    die_at: dict[int, list[int]] = {}
    """Rank -> steps at which the process serving that rank exits, once each."""
    die_at_exchange: dict[int, list[tuple[int, int]]] = {}
    """Rank -> (step, exchange: 0 at +eps, 1 at -eps) before which the process serving that rank exits, once each."""
    stall_at_exchange: dict[int, list[tuple[int, int]]] = {}
    """Rank -> (step, exchange) before which that rank waits, alive, until another's exchange failed (timed out)."""
    die_at_regroup: dict[int, list[int]] = {}
    """Rank -> group generations before whose rendezvous the process serving that rank exits, once each."""
    marker_dir: str | None = None
    """Where each exit leaves a marker, so the restarted process does not exit there again."""
    build_error: str | None = None
    """A message a rank's first build raises as a `WorkloadError`."""
    standby_builds_after: str | None = None
    """A path: a standby builds its model only once the file exists, so a loss meets a standby not yet ready."""

    @property
    def steps_hooked(self) -> bool:
        return bool(self.die_at)

    def before_step(self, rank: int, step: int) -> None:
        if step in self.die_at.get(rank, ()):
            marker = os.path.join(self.marker_dir, f"rank{rank}-step{step}")
            if not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)  # an abrupt software failure: unsent records are lost

    def before_exchange(self, rank: int, step: int, exchange: int) -> None:
        if [step, exchange] in [list(at) for at in self.die_at_exchange.get(rank, ())]:
            marker = os.path.join(self.marker_dir, f"rank{rank}-step{step}-exchange{exchange}")
            if not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)  # its shards' losses of this exchange never leave the process
        if [step, exchange] in [list(at) for at in self.stall_at_exchange.get(rank, ())]:
            marker = os.path.join(self.marker_dir, f"rank{rank}-step{step}-exchange{exchange}-stalled")
            if not os.path.exists(marker):
                open(marker, "w").close()
                while not any(name.startswith("failed-") and not name.startswith(f"failed-rank{rank}-")
                              for name in os.listdir(self.marker_dir)):
                    time.sleep(0.05)

    def after_exchange_failed(self, rank: int, step: int, exchange: int) -> None:
        if self.marker_dir is not None:
            open(os.path.join(self.marker_dir, f"failed-rank{rank}-step{step}-exchange{exchange}"), "w").close()

    def before_regroup(self, rank: int, generation: int) -> None:
        if generation in self.die_at_regroup.get(rank, ()):
            marker = os.path.join(self.marker_dir, f"rank{rank}-regroup{generation}")
            if not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)  # planned into the new group, never arrives

    def after_restore(self) -> None:
        marker = self.crash_in_recovery_marker
        if marker and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)  # die with the image loaded and its records not yet replayed

    def before_build(self, standby: bool) -> None:
        if self.build_error and not standby:
            from zocheck_ray.workload.errors import WorkloadError

            raise WorkloadError(self.build_error)
        while standby and self.standby_builds_after and not os.path.exists(self.standby_builds_after):
            time.sleep(0.05)

    def after_replay(self, steps: int) -> None:
        if self.replay_delay_seconds:
            time.sleep(self.replay_delay_seconds * steps)


NO_FAULTS = FaultInjection()
