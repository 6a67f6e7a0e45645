"""What a trainer group reports to the controller: a recovery, and its ranks' step times."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from zocheck_ray.runtime.messages import RecoveryInfo, TrainerProgress, TrainerTimes


@dataclass
class Restored:
    """A recovery: the lost rank's restore, and where the time went."""

    rank: int
    info: RecoveryInfo
    replaced_by: str
    """`standby` (promoted), `restart` (Ray restarted the process) or `torn` (no process was lost)."""
    phases: dict[str, float] = field(default_factory=dict)


@dataclass
class StepTimes:
    """The ranks' step and collective times over the run and over the last segment."""

    rank_seconds: list[float]
    rank_steps: list[int]
    collective_seconds: float = 0.0
    collective_steps: int = 0
    recent: TrainerTimes | None = None
    held_out_step: int | None = None
    held_out: dict[str, float] = field(default_factory=dict)
    """The newest held-out evaluation and its step."""

    def add(self, results: dict[int, TrainerProgress], k: int) -> None:
        for r, progress in results.items():
            if progress.evaluations:
                self.held_out_step = max(progress.evaluations)
                self.held_out = dict(progress.evaluations[self.held_out_step])
            self.rank_seconds[r] += sum(progress.step_seconds)
            self.rank_steps[r] += len(progress.step_seconds)
            self.collective_seconds += sum(progress.collective_seconds)
            self.collective_steps += len(progress.collective_seconds)
        if len(results) == k and all(p.step_seconds for p in results.values()):
            gathers = [s for p in results.values() for s in p.collective_seconds]
            self.recent = TrainerTimes(
                rank_seconds_per_step=[statistics.fmean(results[r].step_seconds) for r in range(k)],
                collective_seconds_per_step=statistics.fmean(gathers) if gathers else None,
                held_out_step=self.held_out_step, held_out=dict(self.held_out))
