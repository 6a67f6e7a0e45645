"""`ShadowClient`: the driver's synchronous facade over a run's `ShadowActor`.

It waits through Ray's restart of the shadow and turns Ray's errors into the run's own, so the
controller decides on failures without knowing Ray.
"""

from __future__ import annotations

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayTaskError

from zocheck_ray.actors.link import call_when_alive
from zocheck_ray.actors.names import actor_status, shadow_name
from zocheck_ray.runtime.errors import DrainFailedError, ShadowCallError, ShadowGoneError
from zocheck_ray.runtime.messages import ShadowMetrics, ShadowStatus, TrainerTimes
from zocheck_ray.runtime.errors import ShadowRestartedError


class ShadowClient:
    """The run's shadow, called from the driver."""

    def __init__(self, actor, run_id: str):
        self.actor = actor
        self.name = shadow_name(run_id)

    def _call(self, submit, timeout: float = 300.0):
        try:
            return call_when_alive(submit, timeout)
        except ActorDiedError as exc:
            raise ShadowGoneError(str(exc).splitlines()[0]) from exc
        except RayTaskError as exc:
            if isinstance(exc.cause, ShadowRestartedError):
                raise exc.cause from exc
            raise ShadowCallError(str(exc.cause) if exc.cause else str(exc).splitlines()[0]) from exc

    def status(self) -> ShadowStatus:
        return self._call(lambda: self.actor.status.remote())

    def metrics(self, trainers: TrainerTimes | None = None) -> ShadowMetrics:
        return self._call(lambda: self.actor.metrics.remote(trainers))

    def note_dev(self, losses: dict[int, float], through: int) -> None:
        """The dev losses so far (`Shadow.note_dev`)."""
        self._call(lambda: self.actor.note_dev.remote(losses, through))

    def drain(self, step: int, timeout: float, incarnation: str | None = None) -> ShadowMetrics:
        """Replay to `step` and make its image durable (`Shadow.drain`). Raises `ShadowRestartedError`
        if a new incarnation answered, `DrainFailedError` if it failed."""
        try:
            return self._call(lambda: self.actor.drain.remote(step, timeout, incarnation))
        except DrainFailedError:
            raise
        except ShadowCallError as exc:
            raise DrainFailedError(str(exc)) from exc.__cause__

    def resync(self, step: int) -> None:
        self._call(lambda: self.actor.resync.remote(step))

    def abort_intake(self) -> None:
        self._call(lambda: self.actor.abort_intake.remote())

    def replica_hash(self) -> tuple[int, str]:
        return self._call(lambda: self.actor.replica_hash.remote())

    def profile_replay(self, threads: int) -> float | None:
        return self._call(lambda: self.actor.profile_replay.remote(threads))

    def profile_snapshot(self) -> float:
        return self._call(lambda: self.actor.profile_snapshot.remote())

    def last_persist_seconds(self) -> float | None:
        return self._call(lambda: self.actor.last_persist_seconds.remote())

    def end_profile(self, threads: int, snapshot_interval: int, regime: str, durable_interval: int | None) -> None:
        self._call(lambda: self.actor.end_profile.remote(threads, snapshot_interval, regime, durable_interval))

    def pid(self) -> int:
        return self._call(lambda: self.actor.pid.remote())

    def kill(self) -> None:
        """Kill the shadow's process as a fault would (Ray restarts it, up to `failure.max_restarts`)."""
        ray.kill(self.actor, no_restart=False)

    def close(self, timeout: float) -> tuple[bool, str | None]:
        """Seal the log and release the run's lease; returns (released, why not)."""
        status = actor_status(self.name)
        if status is not None and status.state != "ALIVE":
            return False, None
        try:
            return ray.get(self.actor.close.remote(), timeout=timeout), None
        except (RayActorError, RayTaskError, GetTimeoutError) as exc:
            return False, f"the shadow did not close within {timeout:g} s: {str(exc).splitlines()[0]}"
