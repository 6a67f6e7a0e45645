"""`BestDev`: the snapshot MeZO's `--load_best_model_at_end` keeps (docs/running.md, "The best dev snapshot").

Each evaluation step's snapshot is held until its dev loss is known; the lowest is pinned.
"""

from __future__ import annotations

from zocheck_ray.config import JobConfig
from zocheck_ray.storage.retention import Retention

PIN = "best_dev"
"""The name of the best dev step's pin in `retention.json`."""


class BestDev:
    """The best dev step so far, and the steps that get their own snapshot."""

    def __init__(self, job: JobConfig):
        self.enabled = job.task.num_dev is not None
        self.interval, self.last_step = job.task.eval_interval, job.steps
        self.step: int | None = None
        self.loss: float | None = None
        self.released_through = -1  # every evaluation step up to here was decided

    def forced(self, step: int) -> int | None:
        """The first evaluation step after `step`; None without dev rows."""
        if not self.enabled:
            return None
        following = (step // self.interval + 1) * self.interval
        return min(following, self.last_step) if self.last_step > step else following

    def holds(self, step: int) -> bool:
        """Whether the snapshot of `step` is saved with `hold`."""
        return step > 0 and self.forced(step - 1) == step

    def restore(self, retention: Retention) -> None:
        """Take up the durable choice (a rebuilt shadow, a resumed run)."""
        if PIN in retention.pins:
            self.step = retention.pins[PIN]
            self.loss = retention.notes.get(PIN, {}).get("dev_loss")
        self.released_through = max(self.released_through, retention.released_through)

    def note(self, losses: dict[int, float], through: int) -> bool:
        """Dev losses by step, evaluated up to `through`; whether the retention changed."""
        before = (self.step, self.released_through)
        for step, loss in sorted(losses.items()):
            if step > 0 and (self.step is None or self.loss is None or (loss, step) < (self.loss, self.step)):
                self.step, self.loss = step, loss
        self.released_through = max(self.released_through, through)
        return (self.step, self.released_through) != before

    def retention(self) -> Retention:
        """What `retention.json` says of it."""
        if self.step is None:
            return Retention(released_through=self.released_through)
        return Retention(pins={PIN: self.step}, released_through=self.released_through,
                         notes={PIN: {"dev_loss": self.loss}})
