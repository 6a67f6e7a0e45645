"""What the shadow's metrics say after a segment: a `Failure`, warnings, or nothing."""

from __future__ import annotations

from zocheck_ray.runtime.messages import ShadowStatus, TrainerProgress
from zocheck_ray.config import JobConfig
from zocheck_ray.control.callbacks import Controller
from zocheck_ray.control.policy import Failure
from zocheck_ray.storage.fs import parse_url


class Monitor:
    """Watches the shadow across segments: its restarts, its durability, its lag."""

    def __init__(self, job: JobConfig):
        self.job = job
        self.shadow_incarnation: str | None = None
        self.shadow_restarts = 0
        self._warned_durability = False
        # On an object store a log segment is uploaded once it holds `durability.log_seal_records` records (or is
        # 60 s old): that many steps are not durable by design, and do not count against
        # `durability.max_undurable_steps`.
        self.seal_window = 0 if parse_url(job.run_url)[0] == "file" else job.durability.log_seal_records

    def check(self, run: Controller, m: ShadowStatus, progress: TrainerProgress) -> Failure | None:
        """What the segment's metrics say is wrong, if anything; warnings go to `run.warn`."""
        if m.incarnation != self.shadow_incarnation:
            self.shadow_incarnation = m.incarnation
            self.shadow_restarts += 1
            run.warn(f"the shadow restarted (it came back from durable storage); the trainer re-sends what it "
                     f"lacks ({progress.publisher.resent_records} records so far)")
        if m.persist_stopped:
            return Failure("writer_lost", run.step, m.persist_error)
        if m.replay_error:
            return Failure("replay_error", run.step, m.replay_error)
        if progress.publisher.gap:
            return Failure("records_lost", run.step, progress.publisher.gap)
        failure = self._durability(run, m)
        if failure is None and m.lag_steps > run.max_lag_steps:
            failure = Failure("shadow_lag", run.step, f"lag {m.lag_steps} steps")
        return failure

    def _durability(self, run: Controller, m: ShadowStatus) -> Failure | None:
        job = self.job
        behind = m.undurable_steps - self.seal_window  # beyond what an object store's open segment holds by design
        if behind > job.durability.max_undurable_steps:
            return Failure("durability_stalled", run.step,
                           f"{m.undurable_steps} steps are not durable in {job.run_url} (last storage error: "
                           f"{m.persist_error or 'none; storage is too slow'})")
        if (behind > job.durability.max_undurable_steps // 10 or m.persist_error) and not self._warned_durability:
            self._warned_durability = True
            run.warn(f"durability is behind: {m.undurable_steps} steps not in the durable log of {job.run_url}, "
                     f"its newest durable snapshot of step {m.durable_step}, {m.persist_failures} failed writes "
                     f"(last: {m.persist_error or 'none'}); the run fails beyond "
                     f"{job.durability.max_undurable_steps + self.seal_window} steps not in the log")
        elif self._warned_durability and not m.persist_error \
                and behind <= job.durability.max_undurable_steps // 10:
            self._warned_durability = False
            run.warn(f"durability caught up: {m.undurable_steps} steps not durable")
        return None
