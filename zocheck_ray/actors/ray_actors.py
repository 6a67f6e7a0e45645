"""Ray transport for `Trainer` and `Shadow`: actors and the link between them.

Records travel trainer -> shadow in batches from one publishing thread (so Ray keeps
them in order); every push is answered with what the shadow holds, and the trainer
re-sends what a restarted shadow lacks (see `actors/publisher.py`). Images travel as
one flat buffer in the object store, owned by the shadow process: a trainer failure
finds them alive; a shadow failure is repaired from durable storage plus the
trainer's re-sent records; a node loss from the durable snapshot and log.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import uuid

import ray
import torch
from ray.exceptions import ActorUnavailableError, ObjectLostError, RayActorError

from zocheck_ray.actors.image import pack, unpack
from zocheck_ray.actors.metrics import numeric_fields
from zocheck_ray.actors.publisher import PushReply
from zocheck_ray.actors.shadow import Shadow
from zocheck_ray.actors.trainer import Trainer
from zocheck_ray.config import JobConfig
from zocheck_ray.core.record import decode_records
from zocheck_ray.faults import FaultInjection

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


def wait_until_alive(actor, timeout: float = 300.0) -> None:
    """Return once the GCS reports `actor` alive (or dead, or after `timeout`). A task sent to an
    actor while Ray restarts it waits on Ray's death-info timer (1 s or more) before it fails and
    can be sent again, so a caller that just polls learns of the restart seconds late; the GCS's
    actor table says it at once."""
    try:
        from ray._private.state import actors
    except ImportError:  # another Ray: callers fall back to calling until the actor answers
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = actors(actor_id=actor._actor_id.hex()).get("State")
        except Exception:  # the table is unreachable: fall back as above
            return
        if state in ("ALIVE", "DEAD", None):
            return
        time.sleep(0.01)


def actor_state(actor) -> str:
    """What the GCS's actor table says of `actor`, in words: its state (ALIVE, RESTARTING, DEAD, ...), its
    process and its restarts; "unknown" where the table cannot be read."""
    try:
        from ray._private.state import actors

        entry = actors(actor_id=actor._actor_id.hex())
    except Exception:  # another Ray, or the table is unreachable
        return "unknown"
    where = entry.get("Address") or {}
    return (f"{entry.get('State', 'unknown')} (pid {entry.get('Pid') or '-'} on {where.get('IPAddress') or '-'}, "
            f"{entry.get('NumRestarts', 0)} restarts)")


def shadow_name(run_id: str) -> str:
    return f"zocheck-shadow-{run_id}"


def shadow_writer(run_id: str) -> str:
    """The shadow's name in its run's storage lease. An actor name is unique in a cluster, so a
    holder of this name is a dead predecessor (a restart, a lost node): the new shadow reclaims it."""
    return f"shadow:{run_id}@{ray.get_runtime_context().gcs_address}"


def settle_heap() -> None:
    """Move what a constructor built (modules, model, kernels: alive as long as the process) out of the
    cyclic collector's reach, so its passes walk only what the loops allocate (the shadow spent a tenth
    of its CPU in `gc` walking start-up objects)."""
    gc.collect()
    gc.freeze()


def trainer_name(run_id: str, rank: int = 0) -> str:
    """Rank 0 keeps the single trainer's name; data-parallel rank r > 0 is `...-rank{r}`."""
    return f"zocheck-trainer-{run_id}" + (f"-rank{rank}" if rank else "")


@ray.remote(num_gpus=0, concurrency_groups={"inbox": 1, "control": 4})
class ShadowActor:
    """CPU-only shadow (see `Shadow`): pushes on one thread in order, everything else beside them."""

    def __init__(self, job: dict, faults: dict | None = None):
        logging.basicConfig(level=logging.INFO)
        self.job = JobConfig.model_validate(job)
        threads = max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
        # replay and persistence at `shadow_nice`; Ray's threads and this actor's methods keep Ray's niceness
        self.shadow = Shadow(self.job, publish=ray.put, threads=threads,
                             faults=FaultInjection.model_validate(faults or {}), writer=shadow_writer(self.job.run_id),
                             nice=self.job.shadow_nice)
        self._gauges = None
        settle_heap()

    @ray.method(concurrency_group="control")
    def ready(self) -> bool:
        return True

    @ray.method(concurrency_group="inbox")  # one at a time, in submission order
    def push(self, data: bytes, trainer_step: int | None = None) -> tuple:
        return tuple(self.shadow.push(data, trainer_step))

    @ray.method(concurrency_group="control")
    def initialize(self, packed: list, step: int) -> None:
        buffer, layout = ray.get(packed[0]), packed[1]
        self.shadow.initialize(unpack(buffer, layout, copy=False), step)

    @ray.method(concurrency_group="control")
    def resync(self, packed: list, step: int, wait_seconds: float = 60.0) -> None:
        buffer, layout = ray.get(packed[0]), packed[1]
        self.shadow.resync(unpack(buffer, layout, copy=False), step, wait_seconds)

    @ray.method(concurrency_group="control")
    def recovery_image(self) -> dict | None:
        image, records = self.shadow.recovery_image()
        if image is None:
            return None
        return {"ref": [image.handle], "layout": image.layout, "step": image.step,
                "records": b"".join(r.to_bytes() for r in records), "source": self.shadow.replay.source}

    @ray.method(concurrency_group="control")
    def metrics(self, trainers: dict | None = None) -> dict:
        """The shadow's metrics; `trainers` (from the controller): the ranks' step times to report with them."""
        if trainers:
            self.shadow.note_trainers(**trainers)
        m = self.shadow.metrics()
        self._export(m)
        return m.model_dump()

    def _export(self, m) -> None:
        from ray.util.metrics import Gauge

        values = numeric_fields(m)
        if self._gauges is None:
            self._gauges = {n: Gauge(f"zocheck_shadow_{n}", description=f"zocheck-ray shadow {n}",
                                     tag_keys=("run_id",)) for n in type(m).model_fields
                            if n not in ("run_id", "incarnation", "regime", "source", "rank_seconds_per_step")
                            and not n.endswith("_error")}
            self._rank_gauge = Gauge("zocheck_shadow_rank_seconds_per_step", tag_keys=("run_id", "rank"),
                                     description="zocheck-ray trainer rank's mean step seconds (last segment)")
        for name, gauge in self._gauges.items():
            if name in values:
                gauge.set(values[name], tags={"run_id": m.run_id})
        for rank, seconds in enumerate(m.rank_seconds_per_step):
            self._rank_gauge.set(seconds, tags={"run_id": m.run_id, "rank": str(rank)})

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
    def end_profile(self, threads: int, snapshot_interval: int, regime: str = "unknown") -> None:
        self.shadow.end_profile(threads, snapshot_interval, regime)

    @ray.method(concurrency_group="control")
    def replica_hash(self) -> tuple[int, str]:
        return self.shadow.replica_hash()

    @ray.method(concurrency_group="control")
    def drain(self, step: int, timeout: float = 300.0) -> dict:
        """Every record before `step` replayed, the image of `step` taken and durable; returns the metrics."""
        m = self.shadow.drain(step, timeout)
        self._export(m)
        return m.model_dump()

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def close(self) -> None:
        self.shadow.close()


class RayShadowLink:
    """The trainer's side of the link, over a named `ShadowActor`."""

    def __init__(self, run_id: str):
        self.actor = ray.get_actor(shadow_name(run_id), namespace=NAMESPACE)

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
        records = decode_records(found["records"])
        source = "durable" if found["source"] == "durable" else "memory"
        return unpack(buffer, found["layout"], copy=True), found["step"], records, source

    def initialize(self, state: dict[str, torch.Tensor], step: int) -> None:
        buffer, layout = pack(state)
        ref = ray.put(buffer)
        call_when_alive(lambda: self.actor.initialize.remote([ref, layout], step))

    def push(self, data: bytes, trainer_step: int):
        return self.actor.push.remote(data, trainer_step)

    def poll(self, handles: list) -> list:
        done, _ = ray.wait(handles, num_returns=len(handles), timeout=0, fetch_local=True)
        out = []
        for ref in done:
            try:
                out.append((ref, PushReply(*ray.get(ref))))
            except Exception as exc:  # the shadow died or is restarting: the publisher asks again later
                out.append((ref, exc))
        return out


@ray.remote
class TrainerActor:
    """Runs the ZO loop on its GPU (or the CPU); recovers exactly in its constructor."""

    def __init__(self, job: dict, faults: dict | None = None, rank: int = 0):
        logging.basicConfig(level=logging.INFO)
        self.job = JobConfig.model_validate(job)
        device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
        self.incarnation = uuid.uuid4().hex  # tells a restarted trainer from the one before
        # A restarted data-parallel rank recovers when the controller says to which step (`rejoin`).
        defer = self.job.trainers > 1 and ray.get_runtime_context().was_current_actor_reconstructed
        if self.job.trainers > 1:  # k ranks on a node share its cores: each uses the CPUs it reserved
            import numba

            cpus = max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
            numba.set_num_threads(min(cpus, numba.config.NUMBA_NUM_THREADS))
            torch.set_num_threads(cpus)
        self.trainer = Trainer(self.job, RayShadowLink(self.job.run_id), device=device,
                               faults=FaultInjection.model_validate(faults or {}), rank=rank, defer_recovery=defer)
        settle_heap()

    def pid(self) -> int:
        return os.getpid()

    @ray.method(max_task_retries=-1)  # a query: sent while Ray restarts the actor, it waits for the new one
    def recovery(self) -> dict:
        return {**self.trainer.recovery, "incarnation": self.incarnation}

    def run(self, until_step: int, die_at_step: int | None = None, durable_next: int | None = None) -> dict:
        return self.trainer.run(until_step, die_at_step, durable_next)

    def group_address(self, loopback: bool = False) -> tuple[str, int]:
        """Rank 0: open the ranks' rendezvous on this node's address (127.0.0.1 with `loopback`: every rank
        is on this node) and return it with the port it listens on."""
        address = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        return address, self.trainer.group.listen(address)

    def join_group(self, address: str, port: int) -> float:
        return self.trainer.join_group(address, port)

    def deliver(self) -> int:
        return self.trainer.deliver()

    def rejoin(self, step: int | None) -> dict:
        return {**self.trainer.rejoin(step), "incarnation": self.incarnation}

    def export_state(self) -> list:
        state, step = self.trainer.export_state()
        buffer, layout = pack(state)
        return [ray.put(buffer), layout, step]

    def resynced(self, step: int) -> None:
        self.trainer.publisher.clear_gap(step)

    def state_hash(self) -> tuple[int, str]:
        return self.trainer.state_hash()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def step_time(self) -> dict:
        return self.trainer.progress()

    def publisher_stats(self) -> dict:
        return self.trainer.publisher.stats()
