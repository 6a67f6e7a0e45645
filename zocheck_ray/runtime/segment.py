"""`SegmentLog`: what a trainer reports after a segment of steps, gathered as it trains (`TrainerProgress`)."""

from __future__ import annotations

import statistics


class SegmentLog:
    """Each step's time, publish cost, hash and loss, and the evaluations taken; `take` hands them over once."""

    def __init__(self):
        self.publish_ns: list[int] = []
        """Each step's publish cost on the training thread (ns), since the trainer was built."""
        self.step_hashes: dict[int, str] = {}
        self.step_seconds: list[float] = []
        self.last_loss: float | None = None
        self.evaluations: dict[int, dict[str, float]] = {}
        self.samples: dict[int, list[tuple[str, str]]] = {}
        self.eval_seconds = 0.0
        self.evaluated: set[int] = set()
        """Every step evaluated (not only this segment's): a recovery resuming at one does not evaluate it again."""

    def stepped(self, seconds: float, publish_ns: int, loss: float | None) -> None:
        self.step_seconds.append(seconds)
        self.publish_ns.append(publish_ns)
        self.last_loss = loss

    def evaluation(self, step: int, metrics: dict[str, float], samples, seconds: float) -> None:
        self.evaluations[step] = metrics
        if samples is not None:
            self.samples[step] = samples
        self.eval_seconds += seconds
        self.evaluated.add(step)

    def take(self) -> dict:
        """The segment's fields of `TrainerProgress`, reset for the next segment."""
        recent = self.publish_ns[-1000:]
        out = {"step_hashes": self.step_hashes, "step_seconds": self.step_seconds, "evaluations": self.evaluations,
               "samples": self.samples, "eval_seconds": self.eval_seconds, "loss": self.last_loss,
               "publish_us_median": statistics.median(recent) / 1e3 if recent else None}
        self.step_hashes, self.step_seconds, self.evaluations, self.samples = {}, [], {}, {}
        self.eval_seconds = 0.0
        return out
