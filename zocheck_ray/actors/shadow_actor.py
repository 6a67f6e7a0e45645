"""`ShadowActor`: the shadow's Ray actor, in a module that imports nothing but Ray.

Everything the shadow does is `Shadow`'s (`runtime/shadow.py`); this is its Ray face, with pushes
on one thread so they apply in order, and everything else beside them.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import ray

from zocheck_ray.actors.names import is_ours

if TYPE_CHECKING:
    from zocheck_ray.host.handle import ImageHandle
    from zocheck_ray.runtime.messages import AdapterIdentity, RecoveryOffer, ShadowMetrics, ShadowStatus, TrainerTimes
    from zocheck_ray.runtime.shadow import Shadow


def shadow_writer(run_id: str) -> str:
    """The shadow's name in its run's lease; actor names are unique in a cluster, so another holder of it is a dead
    predecessor, whose lease the new shadow reclaims."""
    return f"shadow:{run_id}@{ray.get_runtime_context().gcs_address}"


@ray.remote(num_gpus=0, concurrency_groups={"inbox": 1, "control": 4, "watch": 2})
class ShadowActor:
    """The CPU-only shadow's actor."""

    def __init__(self, job: dict, hooks=None):
        from zocheck_ray.host.heap import settling_heap

        logging.basicConfig(level=logging.INFO)
        threads = max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
        self.node_id = ray.get_runtime_context().get_node_id()
        with settling_heap():  # the imports (torch, numba, storage) and the shadow's set-up
            from zocheck_ray.runtime.hooks import NO_HOOKS
            from zocheck_ray.runtime.shadow import Shadow
            from zocheck_ray.config import JobConfig

            self.job = JobConfig.model_validate(job)
            self._refusal: Exception | None = None
            try:  # replay and persistence run at `shadow.nice`; Ray's threads and the actor's methods do not
                self._shadow = Shadow(self.job, threads=threads, hooks=hooks or NO_HOOKS,
                                      writer=shadow_writer(self.job.run_id), nice=self.job.shadow.nice)
            except Exception as exc:
                if ray.get_runtime_context().was_current_actor_reconstructed or not is_ours(exc):
                    raise
                # Ray prints a constructor's error with its traceback (and aborts its process) above the run's one
                # line: a first start raises it from every call instead, `ready` first
                self._refusal = exc
        self._gauges = None

    @property
    def shadow(self) -> Shadow:
        if self._refusal is not None:
            raise self._refusal
        return self._shadow

    @ray.method(concurrency_group="control")
    def ready(self) -> bool:
        return self.shadow is not None

    @ray.method(concurrency_group="inbox")  # one at a time, in submission order
    def push(self, data: bytes, trainer_step: int | None = None) -> tuple:
        return tuple(self.shadow.push(data, trainer_step))

    @ray.method(concurrency_group="control")
    def open_intake(self, names: tuple, dtypes: tuple, shapes: tuple) -> ImageHandle:
        """Memory on this node for a trainer to write its state into."""
        from zocheck_ray.host.handle import ImageHandle
        from zocheck_ray.host.image import ImageLayout

        layout = ImageLayout.from_specs(list(zip(names, dtypes, shapes)))
        buffer = self.shadow.open_intake(layout)
        return ImageHandle.of(buffer, layout, token="intake", step=None, node_id=self.node_id)

    @ray.method(concurrency_group="control")
    def initialize(self, step: int, adapter: AdapterIdentity | None = None, model_config: dict | None = None) -> None:
        self.shadow.initialize(step, adapter=adapter, model_config=model_config)

    @ray.method(concurrency_group="control")
    def resync(self, step: int, wait_seconds: float = 60.0) -> None:
        self.shadow.resync(step, wait_seconds=wait_seconds)

    @ray.method(concurrency_group="control")
    def abort_intake(self) -> None:
        self.shadow.abort_intake()

    @ray.method(concurrency_group="control")
    def offer_image(self, fresh: bool = False, held: str | None = None) -> RecoveryOffer | None:
        """The newest image (lent until `give_back`) and the records after it; None for a fresh run
        (`fresh`, `held`: see `Shadow.offer`)."""
        from zocheck_ray.host.handle import ImageHandle
        from zocheck_ray.runtime.messages import RecoveryOffer

        image, records = self.shadow.offer(fresh, held)
        if image is None:
            return None
        handle = ImageHandle.of(image.buffer, image.layout, token=image.token, step=image.step,
                                node_id=self.node_id)
        return RecoveryOffer(image=handle, records=b"".join(r.to_bytes() for r in records),
                             source=self.shadow.replay.source, adapter=self.shadow.adapter)

    @ray.method(concurrency_group="watch")  # long waits, on threads of their own
    def newer_image(self, token: str | None, timeout: float) -> int | None:
        """The step of an image other than `token` offered within `timeout` s, or None."""
        return self.shadow.newer_image(token, timeout)

    @ray.method(concurrency_group="control")
    def give_back(self, token: str) -> None:
        self.shadow.give_back(token)

    @ray.method(concurrency_group="control")
    def image_window(self, token: str, start: int, length: int):
        """Bytes `start..start+length` of the lent image `token`, for a reader on another node."""
        return self.shadow.image_bytes(token, start, length)

    @ray.method(concurrency_group="control")
    def write_intake(self, start: int, data) -> None:
        """Bytes at `start` of the open intake, from a trainer that cannot open it (the plain path)."""
        self.shadow.write_intake(start, data)

    @ray.method(concurrency_group="control")
    def status(self) -> ShadowStatus:
        """What the controller decides on (`Shadow.status`)."""
        return self.shadow.status()

    @ray.method(concurrency_group="control")
    def metrics(self, trainers: TrainerTimes | None = None) -> ShadowMetrics:
        """The shadow's metrics, reporting the ranks' step times `trainers` with them."""
        if trainers is not None:
            self.shadow.note_trainers(trainers)
        m = self.shadow.metrics()
        self._export(m)
        return m

    @ray.method(concurrency_group="control")
    def note_dev(self, losses: dict, through: int) -> None:
        """The trainer's dev losses by step, evaluated up to `through` (`Shadow.note_dev`)."""
        self.shadow.note_dev(losses, through)

    def _export(self, m) -> None:
        from ray.util.metrics import Gauge

        from zocheck_ray.runtime.messages import numeric_fields

        values = numeric_fields(m)
        if self._gauges is None:
            self._gauges = {n: Gauge(f"zocheck_shadow_{n}", description=f"zocheck-ray shadow {n}",
                                     tag_keys=("run_id",)) for n in type(m).model_fields
                            if n not in ("run_id", "incarnation", "regime", "source", "rank_seconds_per_step", "standby",
                                      "rank_shards", "last_group_change", "best_dev_snapshot")
                            and not n.endswith("_error")}
            self._rank_gauge = Gauge("zocheck_shadow_rank_seconds_per_step", tag_keys=("run_id", "rank"),
                                     description="zocheck-ray trainer rank's mean step seconds (last segment)")
            self._shards_gauge = Gauge("zocheck_shadow_rank_shards", tag_keys=("run_id", "rank"),
                                       description="zocheck-ray trainer rank's shards of the batch")
        for name, gauge in self._gauges.items():
            if name in values:
                gauge.set(values[name], tags={"run_id": m.run_id})
        for rank, seconds in enumerate(m.rank_seconds_per_step):
            self._rank_gauge.set(seconds, tags={"run_id": m.run_id, "rank": str(rank)})
        for rank, shards in enumerate(m.rank_shards):
            self._shards_gauge.set(len(shards), tags={"run_id": m.run_id, "rank": str(rank)})

    @ray.method(concurrency_group="control")
    def profile_replay(self, threads: int) -> float | None:
        return self.shadow.profile_replay(threads)

    @ray.method(concurrency_group="control")
    def profile_snapshot(self) -> float:
        return self.shadow.profile_snapshot()

    @ray.method(concurrency_group="control")
    def last_persist_seconds(self) -> float | None:
        return self.shadow.last_persist_seconds

    @ray.method(concurrency_group="control")
    def end_profile(self, threads: int, snapshot_interval: int, regime: str = "unknown",
                    durable_interval: int | None = None) -> None:
        self.shadow.end_profile(threads, snapshot_interval, regime, durable_interval)

    @ray.method(concurrency_group="control")
    def replica_hash(self) -> tuple[int, str]:
        return self.shadow.replica_hash()

    @ray.method(concurrency_group="control")
    def drain(self, step: int, timeout: float = 300.0, incarnation: str | None = None) -> ShadowMetrics:
        """Replay to `step` and make its image durable; returns the metrics (see `Shadow.drain`)."""
        m = self.shadow.drain(step, timeout, incarnation)
        self._export(m)
        return m

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def close(self) -> bool:
        """Seal the log, stop the stages and release the run's lease; returns whether it was released."""
        return self.shadow.close()
