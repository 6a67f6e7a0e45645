"""What the shadow's metrics say after a segment: a `Failure`, warnings, or nothing."""

from __future__ import annotations

from zocheck_ray.runtime.messages import ShadowStatus, TrainerProgress
from zocheck_ray.config import JobConfig
from zocheck_ray.control.callbacks import Controller
from zocheck_ray.control.policy import Failure
from zocheck_ray.storage.fs import parse_url


def storage_recovery_bound_steps(lag_bound_steps: int, durable_interval: int) -> int:
    """The most steps a recovery from storage replays, as the cost model plans it: the lag bound L plus two durable
    intervals D (the steps since the newest durable snapshot, and those while the next is written)."""
    return lag_bound_steps + 2 * durable_interval


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
        if m.persist_stopped:  # storage lost or refusing, or another writer: nothing is retried
            return Failure(m.persist_stop_reason or "writer_lost", run.step, m.persist_error)
        if m.replay_error:
            return Failure("replay_error", run.step, m.replay_error)
        if progress.publisher.gap:
            return Failure("records_lost", run.step, progress.publisher.gap)
        failure = self._durability(run, m)
        if failure is not None and run.stop.requested:
            # The run stops at this boundary anyway, in a line that says what is durable (the drain tells a full disk
            # at once); failing instead would only turn the stop a scheduler asked for into an error.
            failure = None
        if failure is None and m.lag_steps > run.max_lag_steps:
            failure = Failure("shadow_lag", run.step, f"lag {m.lag_steps} steps")
        return failure

    def _snapshot_bound(self, run: Controller, m: ShadowStatus) -> int | None:
        """`storage_recovery_bound_steps` for this run (None without persistence)."""
        if m.durable_interval is None:
            return None
        return storage_recovery_bound_steps(run.max_lag_steps, m.durable_interval)

    def _durability(self, run: Controller, m: ShadowStatus) -> Failure | None:
        job = self.job
        behind = m.undurable_steps - self.seal_window  # beyond what an object store's open segment holds by design
        if behind > job.durability.max_undurable_steps:
            return Failure("durability_stalled", run.step,
                           f"{m.undurable_steps} steps are not durable in {job.run_url} (last storage error: "
                           f"{m.persist_error or 'none; storage is too slow'}), more than "
                           f"durability.max_undurable_steps={job.durability.max_undurable_steps}")
        bound = self._snapshot_bound(run, m)
        snapshot_behind = m.trainer_step - m.durable_step if m.durable_step is not None else None
        # Only while writes fail: a store that is slow but takes its writes holds new images back (one in flight).
        if m.persist_error and bound is not None and snapshot_behind is not None and snapshot_behind > bound:
            return Failure("durability_stalled", run.step,
                           f"the newest durable snapshot in {job.run_url}, of step {m.durable_step}, is "
                           f"{snapshot_behind} steps behind the trainer, more than a recovery from storage may "
                           f"replay ({bound}: the lag bound {run.max_lag_steps} + 2 x the durable interval "
                           f"{m.durable_interval}); last storage error: {m.persist_error}")
        if (behind > job.durability.max_undurable_steps // 10 or m.persist_error) and not self._warned_durability:
            self._warned_durability = True
            stops = f"; the run stops once that snapshot is more than {bound} steps behind the trainer, or beyond " \
                if bound is not None else "; the run fails beyond "
            run.warn(f"durability is behind: {m.undurable_steps} steps not in the durable log of {job.run_url}, "
                     f"its newest durable snapshot of step {m.durable_step}, {m.persist_failures} failed writes "
                     f"(last: {m.persist_error or 'none'}){stops}"
                     f"{job.durability.max_undurable_steps + self.seal_window} steps not in the log")
        elif self._warned_durability and not m.persist_error \
                and behind <= job.durability.max_undurable_steps // 10:
            self._warned_durability = False
            run.warn(f"durability caught up: {m.undurable_steps} steps not durable")
        return None
