"""The checkpointing strategies ZOCheck is compared with, run on the same `Trainer`.

    trainer = StrategyTrainer(job, url, Strategy.parse("async:7"))
    trainer.run(1000)
    trainer.critical_path()["cumulative_seconds"]

Every strategy runs the unmodified `runtime.trainer.Trainer` (same model, data, seeds,
`ZOOptimizer`, and the same publishing path: one `deque.append` per step, sent in
batches by the trainer's publisher thread). What differs is where the records go and
what happens every K steps:

- `log-only`: the records go to a durable `StepLog`; the initial state is written once,
  before the first step (the pretrained model on disk). Recovery replays every record
  from step 0.
- `sync K=<K>`: log, plus a full checkpoint (`SnapshotStore.save`) every K steps on the
  critical path. Recovery loads the newest checkpoint and replays the log after it.
- `async K=<K>`: log, plus every K steps a host copy of the whole state into the
  trainer's staging buffer on the critical path (waiting first for the previous write:
  one write in flight, as CheckFreq does); a background thread persists it. The staging
  buffer and the write in flight die with the trainer process, so recovery loads the
  newest *persisted* checkpoint and replays the log after it.
- `zocheck`: the product (`controller.run`; for failure-free overhead runs, `Trainer` with
  a real `ShadowActor` when Ray is connected, else an in-process `Shadow`).

Records the publisher had not sent when the process died are recomputed by the
restarted trainer (forward passes), for every strategy alike. Replay uses the fused
kernel (`core.replay`), on the trainer's side, as ZOCheck's trainer does.

`critical_path()` returns (the JSON shape the benchmarks embed, keys stable):
    {"strategy": str, "kind": str, "every": int | None, "steps": int,
     "publish_seconds": float,        # sum of the per-step appends
     "checkpoint_seconds": float,     # sum of the checkpoint work on the training thread
     "stall_seconds": float,          # async: part of checkpoint_seconds spent waiting for the previous write
     "cumulative_seconds": float,     # publish_seconds + checkpoint_seconds
     "publish_us_median": float | None, "checkpoints": int, "checkpoint_ms_median": float | None,
     "checkpoints_persisted": int, "train_seconds": float}
"""

from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time
from dataclasses import dataclass

import ray
import torch

from zocheck_ray.host.heap import settling_heap
from zocheck_ray.runtime.messages import TrainerProgress
from zocheck_ray.runtime.publisher import PushReply, StateOffer, poll_answered
from zocheck_ray.runtime.trainer import Trainer
from zocheck_ray.config import JobConfig
from zocheck_ray.core import state_hash
from zocheck_ray.core.record import decode_records
from zocheck_ray.storage import Lease, SnapshotStore, StepLog, read_log

CHECKPOINT_EVERY = 7
"""The paper's smallest baseline interval K."""
PAPER_INTERVALS = (7, 300, 1000)
"""The intervals K of the published comparison."""
KINDS = ("log-only", "sync", "async", "zocheck")


@dataclass(frozen=True)
class Strategy:
    """One checkpointing strategy: `kind` in KINDS, `every` = K for sync and async."""

    kind: str
    every: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"strategy kind {self.kind!r} is not one of {KINDS}")
        if (self.kind in ("sync", "async")) != (self.every is not None):
            raise ValueError(f"strategy {self.kind!r}: K (every) is required for sync and async and only for them")
        if self.every is not None and self.every < 1:
            raise ValueError(f"strategy {self.kind!r}: K must be at least 1 step, got {self.every}")

    @property
    def name(self) -> str:
        return self.kind if self.every is None else f"{self.kind} K={self.every}"

    @property
    def slug(self) -> str:
        return self.kind if self.every is None else f"{self.kind}-{self.every}"

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        """'log-only', 'zocheck', 'sync:300', 'async:7', 'async-7' or 'async K=7'."""
        m = re.fullmatch(r"\s*(log-only|zocheck|sync|async)(?:\s*(?::|-|\s+K=)\s*(\d+))?\s*", text)
        if m is None:
            raise ValueError(f"strategy {text!r}: expected log-only, zocheck, sync:K or async:K (e.g. async:7)")
        return cls(m[1], int(m[2]) if m[2] else None)


def paper_strategies(intervals: tuple[int, ...] = PAPER_INTERVALS, zocheck: bool = True) -> list[Strategy]:
    """log-only, sync and async at every K, and (optionally) zocheck."""
    out = [Strategy("log-only")]
    out += [Strategy(kind, k) for kind in ("sync", "async") for k in intervals]
    return out + ([Strategy("zocheck")] if zocheck else [])


def stage(state: dict[str, torch.Tensor], out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A host copy of `state` (device-to-host on a GPU): the async checkpoint's critical path."""
    if out is None:
        return {name: t.detach().to("cpu", copy=True) for name, t in state.items()}
    for name, t in state.items():
        out[name].copy_(t.detach())
    return out


class DieAt:
    """The baselines' trainer hook: the process exits as it starts step `step` (unsent records are lost)."""

    steps_hooked = True

    def __init__(self):
        self.step: int | None = None

    def before_step(self, rank: int, step: int) -> None:
        if step == self.step:
            os._exit(1)

    def after_restore(self) -> None:
        pass


class DurableLink:
    """The baselines' end of the trainer's publishing path (a `ShadowLink`): records into a
    durable `StepLog` under `log_url`, checkpoints in a `SnapshotStore` under `url`.

    With `log_writable=False` the log is only read (several strategies recovering from one
    shared log must not change it); the records the trainer then publishes are dropped.
    """

    def __init__(self, job: JobConfig, url: str, log_url: str | None = None, log_writable: bool = True):
        self.job, self.url, self.log_url = job, url, log_url or url
        self.store = SnapshotStore(url, job.storage_options)
        self.meta = {"run_id": job.run_id, "zo_config": job.zo.model_dump(mode="json")}
        self.log_writable = log_writable
        # The log's writer holds its lease (repairing what a killed writer left needs it). A
        # trainer restarted after an injected failure is the same writer: it reclaims the
        # lease its killed predecessor still held.
        self.lease = Lease(self.log_url, job.storage_options, owner=f"bench-log:{job.run_id}",
                           lease_seconds=job.durability.lease_seconds).acquire(reclaim=True) if log_writable else None
        self.log: StepLog | None = None
        self.timing: dict = {}
        self._next = 0

    def _open_log(self, resume_step: int) -> None:
        if self.log_writable:
            self.log = StepLog(self.log_url, self.job.storage_options,
                               seal_records=self.job.durability.log_seal_records,
                               resume_step=resume_step, lease=self.lease)

    def borrow_image(self, fresh: bool = False, held: str | None = None):  # a checkpoint: nothing fresher to take
        started = time.perf_counter()
        latest = self.store.latest()
        if latest is None:
            return None
        tensors, _ = self.store.load(latest)
        loaded = time.perf_counter()
        records = read_log(self.log_url, after_step=latest.step - 1, storage_options=self.job.storage_options)
        self.timing = {"checkpoint_step": latest.step, "load_seconds": loaded - started,
                       "read_log_seconds": time.perf_counter() - loaded, "records": len(records)}
        self._open_log(latest.step + len(records))
        self._next = latest.step + len(records)
        return StateOffer(tensors, latest.step, records, "initial" if latest.step == 0 else "checkpoint")

    def initialize(self, state: dict[str, torch.Tensor], step: int, adapter=None, model_config=None) -> None:
        """A fresh run: the initial state is written once, before the first step (with the baseline's own
        metadata: the trainer's adapter and model config are not recorded)."""
        self.store.save(step, state, self.meta)
        self._open_log(step)
        self._next = step

    def push(self, data: bytes, trainer_step: int | None = None) -> PushReply:
        records = decode_records(data)
        if self.log is not None:
            for record in records:
                self.log.append(record)
            self.log.flush()
        self._next = records[-1].step + 1 if records else self._next
        return PushReply("durable-log", self._next, self._next, len(records))

    poll = staticmethod(poll_answered)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.lease is not None:
            self.lease.release()


class InProcessShadowLink:
    """ZOCheck's link to a Ray-free `Shadow` in the same process (failure-free overhead runs):
    the trainer's side is exactly `TrainerActor`'s."""

    def __init__(self, shadow):
        self.shadow = shadow

    def borrow_image(self, fresh: bool = False, held: str | None = None):
        image, records = self.shadow.offer(fresh, held)
        if image is None:
            return None
        return StateOffer(image.tensors(), image.step, records, "memory",
                          release=lambda: self.shadow.give_back(image.token), adapter=self.shadow.adapter)

    def initialize(self, state: dict[str, torch.Tensor], step: int, adapter=None, model_config=None) -> None:
        self.shadow.initialize(step, state, adapter=adapter, model_config=model_config)

    def push(self, data: bytes, trainer_step: int | None = None) -> PushReply:
        return self.shadow.push(data, trainer_step)

    poll = staticmethod(poll_answered)

    def close(self) -> None:
        self.shadow.close()


class ShadowActorLink:
    """ZOCheck's link to a real `ShadowActor` in its own process, as `TrainerActor` has it (an
    in-process shadow's threads would contend with the training thread for the GIL)."""

    def __init__(self, job: JobConfig):
        from zocheck_ray.actors.names import NAMESPACE, shadow_name
        from zocheck_ray.actors.link import RayShadowLink, ShadowActor

        self.actor = ShadowActor.options(name=shadow_name(job.run_id), namespace=NAMESPACE, num_cpus=1).remote(
            job.model_dump(mode="json"))
        ray.get(self.actor.ready.remote())
        self.link = RayShadowLink(job.run_id)

    def borrow_image(self, fresh: bool = False, held: str | None = None):
        return self.link.borrow_image(fresh, held)

    def initialize(self, state: dict[str, torch.Tensor], step: int, adapter=None, model_config=None) -> None:
        self.link.initialize(state, step, adapter, model_config)

    def push(self, data: bytes, trainer_step: int | None = None):
        return self.link.push(data, trainer_step)

    def poll(self, handles: list) -> list:
        return self.link.poll(handles)

    def wait_replayed(self, step: int) -> None:
        ray.get(self.actor.drain.remote(step, 300.0))

    def close(self) -> None:
        ray.get(self.actor.close.remote())
        ray.kill(self.actor)


class StrategyTrainer:
    """`Trainer` under one strategy; its constructor recovers as the strategy does.

    `url`: where the strategy's checkpoints (and, unless `log_url` says otherwise, its log)
    live. For `zocheck` an in-process `Shadow` persists under `job.run_url`.
    """

    def __init__(self, job: JobConfig, url: str, strategy: Strategy, device: str = "cpu",
                 log_url: str | None = None, log_writable: bool = True):
        self.job, self.strategy = job, strategy
        started = time.perf_counter()
        if strategy.kind == "zocheck":
            from zocheck_ray.runtime.shadow import Shadow

            # With Ray connected, the shadow runs in its own process as in the product.
            self.link = ShadowActorLink(job) if ray.is_initialized() else InProcessShadowLink(Shadow(job, threads=1))
        else:
            self.link = DurableLink(job, url, log_url, log_writable)
        self._die = DieAt()
        self.trainer = Trainer(job, self.link, device=device, hooks=self._die)
        self.recovery = {**self.trainer.recovery.model_dump(), **getattr(self.link, "timing", {}),
                         "constructor_seconds": time.perf_counter() - started}
        self.checkpoint_ns: list[int] = []
        self.stall_seconds = 0.0
        self.persisted = 0
        self.train_seconds = 0.0
        self._staging: dict[str, torch.Tensor] | None = None
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None
        self._first_step = self.trainer.step
        if strategy.kind in ("sync", "async"):
            self._install_checkpoint_hook()

    @property
    def opt(self):
        return self.trainer.opt

    @property
    def step(self) -> int:
        return self.trainer.step

    def _install_checkpoint_hook(self) -> None:
        # The trainer's loop is left as it is: its optimizer's step is wrapped, so the
        # checkpoint runs right after each step, on the training thread, and is timed apart.
        opt, real_step, every = self.trainer.opt, self.trainer.opt.step, self.strategy.every
        checkpoint = self._sync_checkpoint if self.strategy.kind == "sync" else self._async_checkpoint

        def step(closure, seed, lr=None):
            record = real_step(closure, seed=seed, lr=lr)
            if opt.step_index % every == 0:
                start = time.perf_counter_ns()
                checkpoint(opt.step_index)
                self.checkpoint_ns.append(time.perf_counter_ns() - start)
            return record

        opt.step = step

    def _sync_checkpoint(self, step: int) -> None:
        self.link.store.save(step, self.trainer.opt.state_tensors(), self.link.meta)
        self.persisted += 1

    def _async_checkpoint(self, step: int) -> None:
        start = time.perf_counter()
        if self._writer is not None:  # one write in flight: the next checkpoint waits for the previous one
            self._writer.join()
        self.stall_seconds += time.perf_counter() - start
        state = self.trainer.opt.state_tensors()
        if self._staging is None:
            self._staging = stage(state)
        else:
            stage(state, out=self._staging)
        if self.trainer.device.type == "cuda":
            torch.cuda.synchronize(self.trainer.device)
        self._writer = threading.Thread(target=self._persist, args=(step, self._staging), name="async-checkpoint",
                                        daemon=True)
        self._writer.start()

    def _persist(self, step: int, staged: dict[str, torch.Tensor]) -> None:
        try:
            self.link.store.save(step, staged, self.link.meta)
            self.persisted += 1
        except BaseException as exc:  # reported by close(); the previous checkpoint stays committed
            self._write_error = exc

    def run(self, until_step: int, die_at_step: int | None = None) -> TrainerProgress:
        """Train up to `until_step` (exclusive); `die_at_step` kills the process there."""
        started = time.perf_counter()
        self._die.step = die_at_step
        progress = self.trainer.run(until_step)
        self.train_seconds += time.perf_counter() - started
        return progress

    def critical_path(self) -> dict:
        """The training thread's checkpointing cost so far (see the module docstring)."""
        publish_ns = self.trainer.log.publish_ns
        checkpoint = sum(self.checkpoint_ns) / 1e9
        publish = sum(publish_ns) / 1e9
        return {"strategy": self.strategy.name, "kind": self.strategy.kind, "every": self.strategy.every,
                "steps": self.step - self._first_step, "publish_seconds": publish, "checkpoint_seconds": checkpoint,
                "stall_seconds": self.stall_seconds, "cumulative_seconds": publish + checkpoint,
                "publish_us_median": statistics.median(publish_ns) / 1e3 if publish_ns else None,
                "checkpoints": len(self.checkpoint_ns),
                "checkpoint_ms_median": statistics.median(self.checkpoint_ns) / 1e6 if self.checkpoint_ns else None,
                "checkpoints_persisted": self.persisted, "train_seconds": self.train_seconds}

    def state_hash(self) -> tuple[int, str]:
        return self.step, state_hash(self.trainer.opt.state_tensors())

    def close(self) -> None:
        self.trainer.close()
        if self._writer is not None:
            self._writer.join()
        if isinstance(self.link, ShadowActorLink):
            self.link.wait_replayed(self.step)
        elif self.strategy.kind == "zocheck":
            self.link.shadow.drain(self.step, timeout=300)
        self.link.close()
        if self._write_error is not None:
            raise RuntimeError(f"an asynchronous checkpoint write failed: {self._write_error}") from self._write_error


class AsyncCheckpointTrainer(StrategyTrainer):
    """`StrategyTrainer` under `async K=every`, its checkpoints and log under `url`."""

    def __init__(self, job: JobConfig, url: str, every: int = CHECKPOINT_EVERY, device: str = "cpu"):
        super().__init__(job, url, Strategy("async", every), device=device)


@ray.remote
class StrategyActor:
    """`StrategyTrainer` in a Ray actor, restarted by Ray after a failure; its constructor recovers."""

    def __init__(self, job: dict, url: str, strategy: str, log_url: str | None = None, log_writable: bool = True):
        job = JobConfig.model_validate(job)
        device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
        with settling_heap():  # as zocheck's trainer starts: a like-for-like restart
            self.trainer = StrategyTrainer(job, url, Strategy.parse(strategy), device, log_url, log_writable)
        self.pid = os.getpid()

    def recovery(self) -> dict:
        return {**self.trainer.recovery, "pid": self.pid}

    def run(self, until_step: int, die_at_step: int | None = None) -> dict:
        progress = self.trainer.run(until_step, die_at_step)
        return {"step": progress.step, "seconds": sum(progress.step_seconds)}

    def critical_path(self) -> dict:
        return self.trainer.critical_path()

    def state_hash(self) -> tuple[int, str]:
        return self.trainer.state_hash()

    def close(self) -> None:
        self.trainer.close()


class CompositeTrainer(StrategyTrainer):
    """One trainer carrying every checkpointing baseline at once, for recovery measurements:
    one shared durable log (`<url>/log`), each baseline's checkpoints under `<url>/<slug>`.

    A failure kills every baseline's staging buffer and write in flight together; each
    baseline then recovers separately from its own checkpoints and the shared log. The
    baselines share the training steps (the records are the same bits for all of them),
    so one run to the failure step serves them all.
    """

    def __init__(self, job: JobConfig, url: str, strategies: list[Strategy], device: str = "cpu",
                 reference_at: int | None = None):
        baselines = [s for s in strategies if s.kind in ("sync", "async")]
        self.reference: tuple[int, str] | None = None
        super().__init__(job, url, Strategy("log-only"), device=device)
        # log-only's checkpoint 0 lives at `url`; each checkpointing baseline starts from the same one.
        initial = {k: v.detach().to("cpu").clone() for k, v in self.trainer.opt.state_tensors().items()}
        self.members = []
        for s in baselines:
            member = _Member(s, SnapshotStore(f"{url.rstrip('/')}/{s.slug}", job.storage_options), self.link.meta)
            member.store.save(self.step, initial, self.link.meta)
            self.members.append(member)
        opt, real_step = self.trainer.opt, self.trainer.opt.step

        def step(closure, seed, lr=None):
            record = real_step(closure, seed=seed, lr=lr)
            if opt.step_index == reference_at:  # the uninterrupted state, should the process die right after
                # Before the checkpoints: an async write started at this step must not gain time to finish.
                self.reference = (opt.step_index, state_hash(opt.state_tensors()))
                with open(os.path.join(_local_dir(url), "reference.json"), "w") as f:
                    json.dump({"step": self.reference[0], "state_hash": self.reference[1]}, f)
            for m in self.members:
                if opt.step_index % m.strategy.every == 0:
                    m.checkpoint(opt.step_index, opt.state_tensors())
            return record

        opt.step = step

    def close(self) -> None:
        super().close()
        for m in self.members:
            m.join()


class _Member:
    def __init__(self, strategy: Strategy, store: SnapshotStore, meta: dict):
        self.strategy, self.store, self.meta = strategy, store, meta
        self.staging, self.writer = None, None

    def checkpoint(self, step: int, state: dict[str, torch.Tensor]) -> None:
        if self.strategy.kind == "sync":
            self.store.save(step, state, self.meta)
            return
        self.join()
        self.staging = stage(state) if self.staging is None else stage(state, out=self.staging)
        self.writer = threading.Thread(target=self.store.save, args=(step, self.staging, self.meta), daemon=True,
                                       name=f"async-checkpoint-{self.strategy.every}")
        self.writer.start()

    def join(self) -> None:
        if self.writer is not None:
            self.writer.join()


def _local_dir(url: str) -> str:
    if "://" in url and not url.startswith("file://"):
        raise ValueError(f"the baselines' recovery comparison needs a local storage directory, not {url}")
    return url.removeprefix("file://")


def read_reference(url: str) -> tuple[int, str]:
    """The state hash `CompositeTrainer(reference_at=...)` wrote under `url`."""
    with open(os.path.join(_local_dir(url), "reference.json")) as f:
        doc = json.load(f)
    return doc["step"], doc["state_hash"]


@ray.remote
class CompositeActor:
    def __init__(self, job: dict, url: str, strategies: list[str], reference_at: int | None = None):
        job = JobConfig.model_validate(job)
        with settling_heap():
            self.trainer = CompositeTrainer(job, url, [Strategy.parse(s) for s in strategies],
                                            reference_at=reference_at)

    def run(self, until_step: int, die_at_step: int | None = None) -> dict:
        progress = self.trainer.run(until_step, die_at_step)
        return {"step": progress.step, "seconds": sum(progress.step_seconds)}

    def state_hash(self) -> tuple[int, str]:
        return self.trainer.state_hash()

    def durable(self) -> dict:
        """Newest committed checkpoint step per baseline (what survives the process)."""
        out = {"log-only": 0}
        for m in self.trainer.members:
            latest = m.store.latest()
            out[m.strategy.name] = latest.step if latest else None
        return out
