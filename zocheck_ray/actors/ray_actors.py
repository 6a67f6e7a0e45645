"""Ray actors around `Trainer` and `Shadow`, and the link between them.

Records travel trainer -> shadow in batches of fire-and-forget `push` calls from
one publishing thread (so Ray keeps them in order); images travel as one flat
buffer in the object store. Images are owned by the shadow process: a trainer
failure finds them alive, a shadow failure is repaired by a resync from the live
trainer, and a node loss by the durable snapshot and log.
"""

from __future__ import annotations

import logging
import time
import uuid

import ray
import torch
from ray.exceptions import ActorUnavailableError, ObjectLostError, RayActorError

from zocheck_ray.actors.image import unpack
from zocheck_ray.actors.shadow import Shadow
from zocheck_ray.actors.trainer import Trainer
from zocheck_ray.config import JobConfig
from zocheck_ray.core import StepRecord

NAMESPACE = "zocheck"


def call_when_alive(submit, timeout: float = 300.0):
    """ray.get(submit()), retried while Ray restarts the actor behind it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(submit())
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def shadow_name(run_id: str) -> str:
    return f"zocheck-shadow-{run_id}"


def trainer_name(run_id: str) -> str:
    return f"zocheck-trainer-{run_id}"


@ray.remote(num_gpus=0, concurrency_groups={"inbox": 1, "control": 4})
class ShadowActor:
    """CPU-only shadow: replay thread, snapshots in the object store, durable persistence."""

    def __init__(self, job: dict):
        logging.basicConfig(level=logging.INFO)
        self.job = JobConfig.model_validate(job)
        threads = max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
        self.shadow = Shadow(self.job, publish=ray.put, threads=threads)
        self._gauges = None

    @ray.method(concurrency_group="control")
    def ready(self) -> bool:
        return True

    @ray.method(concurrency_group="inbox")  # one at a time, in submission order
    def push(self, data: bytes) -> int:
        return self.shadow.push(data)

    @ray.method(concurrency_group="control")
    def initialize(self, packed: list, step: int) -> None:
        buffer, layout = ray.get(packed[0]), packed[1]
        self.shadow.initialize(unpack(buffer, layout, copy=False), step)

    @ray.method(concurrency_group="control")
    def resync(self, packed: list, step: int) -> None:
        buffer, layout = ray.get(packed[0]), packed[1]
        self.shadow.resync(unpack(buffer, layout, copy=False), step)

    @ray.method(concurrency_group="control")
    def recovery_image(self) -> dict | None:
        image, records = self.shadow.recovery_image()
        if image is None:
            return None
        return {"ref": [image.handle], "layout": image.layout, "step": image.step,
                "records": b"".join(r.to_bytes() for r in records), "source": self.shadow.source}

    @ray.method(concurrency_group="control")
    def metrics(self) -> dict:
        m = self.shadow.metrics()
        self._export(m)
        return m.model_dump()

    def _export(self, m) -> None:
        from ray.util.metrics import Gauge

        if self._gauges is None:
            names = ["lag_steps", "lag_seconds", "replay_seconds_per_step", "snapshot_interval", "replayed_step",
                     "received_step", "resync_count"]
            self._gauges = {n: Gauge(f"zocheck_shadow_{n}", description=f"zocheck-ray shadow {n}",
                                     tag_keys=("run_id",)) for n in names}
        for name, gauge in self._gauges.items():
            gauge.set(float(getattr(m, name)), tags={"run_id": m.run_id})

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
    def end_profile(self, threads: int, snapshot_interval: int) -> None:
        self.shadow.end_profile(threads, snapshot_interval)

    @ray.method(concurrency_group="control")
    def wait_replayed(self, step: int, timeout: float = 120.0) -> bool:
        return self.shadow.wait_replayed(step, timeout)

    @ray.method(concurrency_group="control")
    def replica_hash(self) -> tuple[int, str]:
        return self.shadow.replica_hash()

    @ray.method(concurrency_group="control")
    def finish(self, step: int, timeout: float = 300.0) -> dict:
        """Wait for the replica to reach `step`, persist its final image and flush the log."""
        if not self.shadow.wait_replayed(step, timeout):
            raise TimeoutError(f"the shadow did not replay up to step {step} within {timeout} s")
        with self.shadow._replica_lock, self.shadow._lock:
            if self.shadow.image is None or self.shadow.image.step != step:
                self.shadow._snapshot_locked()
            image = self.shadow.image
        self.shadow.flush_log()
        if self.shadow.store is not None and self.shadow.durable_step != image.step:
            self.shadow._persist_now(image)
        return self.metrics()

    @ray.method(concurrency_group="control")
    def close(self) -> None:
        self.shadow.close()


class RayShadowLink:
    """The trainer's side of the link, over a named `ShadowActor`."""

    def __init__(self, run_id: str):
        self.actor = ray.get_actor(shadow_name(run_id), namespace=NAMESPACE)

    @ray.method(concurrency_group="control")
    def recovery_image(self, timeout: float = 300.0):
        # The image may belong to a shadow that is dying right now (both processes lost):
        # ask again until the shadow that answers is one that lives.
        deadline = time.monotonic() + timeout
        while True:
            found = call_when_alive(lambda: self.actor.recovery_image.remote())
            if found is None:
                return None, 0, [], "fresh"
            try:
                buffer = ray.get(found["ref"][0])
                break
            except (ObjectLostError, RayActorError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        records, offset, data = [], 0, found["records"]
        while offset < len(data):
            record, offset = StepRecord.read_from(data, offset)
            records.append(record)
        source = "durable" if found["source"] == "durable" else "memory"
        return unpack(buffer, found["layout"], copy=True), found["step"], records, source

    @ray.method(concurrency_group="control")
    def initialize(self, state: dict[str, torch.Tensor], step: int) -> None:
        from zocheck_ray.actors.image import pack

        buffer, layout = pack(state)
        ref = ray.put(buffer)
        call_when_alive(lambda: self.actor.initialize.remote([ref, layout], step))

    def push(self, data: bytes) -> None:
        self.actor.push.remote(data)


@ray.remote
class TrainerActor:
    """Runs the ZO loop on its GPU (or the CPU); recovers exactly in its constructor."""

    def __init__(self, job: dict):
        logging.basicConfig(level=logging.INFO)
        self.job = JobConfig.model_validate(job)
        device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
        self.incarnation = uuid.uuid4().hex  # tells a restarted trainer from the one before
        self.trainer = Trainer(self.job, RayShadowLink(self.job.run_id), device=device)

    def recovery(self) -> dict:
        return {**self.trainer.recovery, "incarnation": self.incarnation}

    def run(self, until_step: int, die_at_step: int | None = None) -> dict:
        return self.trainer.run(until_step, die_at_step)

    def export_state(self) -> list:
        from zocheck_ray.actors.image import pack

        state, step = self.trainer.export_state()
        buffer, layout = pack(state)
        return [ray.put(buffer), layout, step]

    def state_hash(self) -> tuple[int, str]:
        return self.trainer.state_hash()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def step_time(self) -> dict:
        return self.trainer.progress()
