"""The shadow: replays step records on a host replica, snapshots it, persists it.

`Shadow` is Ray-free (tests drive it directly); `ShadowActor` in `ray_actors.py`
wraps it. Threads:
- the caller's (Ray's) thread: `push` decodes records, checks their order and logs them;
- the replay thread: applies records with the fused kernel, takes a snapshot at
  every multiple of N (a clean boundary), keeps the records after the newest image;
- the persistence thread: flushes the step log and writes the newest snapshot,
  one write in flight; older images are skipped, never queued.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

import numpy as np
import torch

from zocheck_ray.actors.image import ImageLayout, new_buffer, pack_into, unpack
from zocheck_ray.actors.metrics import ShadowMetrics
from zocheck_ray.config import JobConfig
from zocheck_ray.core import StepRecord, replay, state_hash
from zocheck_ray.core.record import decode_records
from zocheck_ray.storage import SnapshotStore, StepLog, recover
from zocheck_ray.workload.models import model_config_dict

logger = logging.getLogger(__name__)

MAX_REPLAY_BATCH = 64


class Image:
    """An immutable copy of the replica at `step`, plus where it lives (a Ray ObjectRef, if any)."""

    def __init__(self, step: int, buffer: np.ndarray, layout: ImageLayout, handle=None):
        self.step, self.buffer, self.layout, self.handle = step, buffer, layout, handle


class Shadow:
    def __init__(self, job: JobConfig, publish: Callable[[np.ndarray], object] | None = None,
                 threads: int | None = None, persist: bool = True):
        self.job = job
        self.zo = job.zo
        self.threads = threads
        self._publish = publish or (lambda buffer: None)
        self.snapshot_interval = job.snapshot_interval or 16
        self._lock = threading.RLock()           # inbox, image and counters
        self._replica_lock = threading.RLock()   # the replica's contents
        self._arrived = threading.Condition(self._lock)
        self._inbox: deque[StepRecord] = deque()
        self._tail: list[StepRecord] = []        # records after the newest image, in order
        self.replica: dict[str, torch.Tensor] | None = None
        self.layout: ImageLayout | None = None
        self.image: Image | None = None
        self.received_step = 0
        self.replayed_step = 0
        self.trainer_step = 0
        self.source = "none"
        self.replay_ema = 0.0
        self.snapshots_taken = 0
        self.snapshots_persisted = 0
        self.resync_count = 0
        self.rejected = 0
        self.last_rejection = ""
        self.last_persist_seconds: float | None = None
        self.last_snapshot_seconds: float | None = None
        self._last_record: StepRecord | None = None
        self._scratch: dict[str, torch.Tensor] | None = None
        self._persist_busy = False
        self._stop = threading.Event()
        self.store = SnapshotStore(job.run_url, job.storage_options) if persist else None
        self._hf_config = model_config_dict(job.model)  # so a snapshot directory loads with from_pretrained
        self.log: StepLog | None = None
        self._log_lock = threading.Lock()
        self._persist_lock = threading.Lock()
        self.durable_step: int | None = None
        if self.store is not None:
            self._try_durable_rebuild()
        self._replay_thread = threading.Thread(target=self._replay_loop, name="zocheck-replay", daemon=True)
        self._replay_thread.start()
        self._persist_thread = threading.Thread(target=self._persist_loop, name="zocheck-persist", daemon=True)
        if self.store is not None:
            self._persist_thread.start()

    # ------------------------------------------------------------------ state in

    def _try_durable_rebuild(self) -> None:
        latest = self.store.latest()
        if latest is None:
            return
        result = recover(self.store, self.job.run_url, storage_options=self.job.storage_options,
                         config=self.zo, threads=self.threads)
        for problem in result.problems:
            logger.warning("durable recovery: %s", problem)
        self._adopt(result.state, result.step, "durable")
        self.durable_step = result.snapshot.step
        logger.info("shadow rebuilt from durable storage at step %d (%d records replayed)", result.step,
                    result.records_replayed)

    def _adopt(self, state: dict[str, torch.Tensor], step: int, source: str) -> None:
        with self._replica_lock, self._lock:
            self.layout = ImageLayout.of(state)
            self.replica = {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}
            self.received_step = self.replayed_step = self.trainer_step = step
            self._inbox.clear()
            self.source = source
            self._snapshot_locked()
        self._open_log(step)

    def _open_log(self, step: int) -> None:
        if self.store is None:
            return
        with self._log_lock:
            if self.log is not None:
                self.log.close()
            self.log = StepLog(self.job.run_url, self.job.storage_options, seal_records=self.job.log_seal_records,
                               resume_step=step)

    def initialize(self, state: dict[str, torch.Tensor], step: int) -> None:
        """A fresh run: the trainer's initial state at `step`."""
        self._adopt(state, step, "fresh")
        if self.store is not None:
            self._persist_now(self.image)

    def resync(self, state: dict[str, torch.Tensor], step: int) -> None:
        """Replace the replica with the trainer's state at `step` (caps the lag)."""
        with self._replica_lock, self._lock:
            self.resync_count += 1
            for name, tensor in state.items():
                self.replica[name].copy_(tensor)
            self.replayed_step = step
            while self._inbox and self._inbox[0].step < step:
                self._inbox.popleft()
            if self.received_step < step:
                self.received_step = self.trainer_step = step
            self._snapshot_locked()
            self.source = "resync"

    @property
    def ready(self) -> bool:
        return self.replica is not None

    # ------------------------------------------------------------------ records in

    def push(self, data: bytes) -> int:
        """Receive a batch of encoded records; returns how many were accepted."""
        records = decode_records(data)
        accepted = 0
        with self._lock:
            for record in records:
                if record.step != self.received_step:
                    self.rejected += 1
                    when = "past" if record.step < self.received_step else "future"
                    self.last_rejection = (f"record of step {record.step} is from the {when}: step "
                                           f"{self.received_step} is next; not applied")
                    logger.warning(self.last_rejection)
                    continue
                self._inbox.append(record)
                self._last_record = record
                self.received_step = record.step + 1
                accepted += 1
            self.trainer_step = max(self.trainer_step, self.received_step)
            if accepted:
                self._arrived.notify_all()
        if accepted and self.log is not None:
            with self._log_lock:
                for record in records[-accepted:]:
                    self.log.append(record)
        return accepted

    # ------------------------------------------------------------------ replay

    def _replay_loop(self) -> None:
        # Lock order: _replica_lock, then _lock. Replay runs outside _lock, so pushes and
        # metrics are never held up by it.
        while not self._stop.is_set():
            with self._lock:
                if not self._inbox or self.replica is None:
                    self._arrived.wait(0.05)
                    continue
            with self._replica_lock:
                with self._lock:
                    boundary = (self.replayed_step // self.snapshot_interval + 1) * self.snapshot_interval
                    batch = []
                    while self._inbox and len(batch) < MAX_REPLAY_BATCH and self._inbox[0].step < boundary:
                        batch.append(self._inbox.popleft())
                    start_step = self.replayed_step
                if not batch:
                    continue
                start = time.perf_counter()
                replay(self.replica, batch, self.zo, threads=self.threads, start_step=start_step)
                if self.job.faults.replay_delay_seconds:
                    time.sleep(self.job.faults.replay_delay_seconds * len(batch))
                per_step = (time.perf_counter() - start) / len(batch)
                with self._lock:
                    self.replay_ema = per_step if self.replay_ema == 0 else 0.8 * self.replay_ema + 0.2 * per_step
                    self.replayed_step += len(batch)
                    self._tail.extend(batch)
                    if self.replayed_step % self.snapshot_interval == 0:
                        self._snapshot_locked()

    def _snapshot_locked(self) -> None:
        start = time.perf_counter()
        buffer = pack_into(new_buffer(self.layout), self.replica, self.layout)
        self.last_snapshot_seconds = time.perf_counter() - start
        handle = self._publish(buffer)
        self.image = Image(self.replayed_step, buffer, self.layout, handle)
        self._tail = []
        self.snapshots_taken += 1

    # ------------------------------------------------------------------ startup profile

    def profile_replay(self, threads: int) -> float | None:
        """Seconds to replay the newest record with `threads` threads, on a scratch copy."""
        with self._lock:
            record = self._last_record
        if record is None:
            return None
        if self._scratch is None:
            with self._replica_lock:
                self._scratch = {k: v.clone() for k, v in self.replica.items()}
        start = time.perf_counter()
        replay(self._scratch, [record], self.zo, threads=threads)
        return time.perf_counter() - start

    def profile_snapshot(self) -> float:
        """Seconds for one snapshot copy of the replica."""
        with self._replica_lock:
            start = time.perf_counter()
            pack_into(new_buffer(self.layout), self.replica, self.layout)
            return time.perf_counter() - start

    def end_profile(self, threads: int, snapshot_interval: int) -> None:
        self._scratch = None
        self.threads = threads
        self.snapshot_interval = snapshot_interval

    def recovery_image(self) -> tuple[Image | None, list[StepRecord]]:
        """The newest image and every received record after it (replayed or not)."""
        # _replica_lock too: a batch the replay thread is applying has left the inbox but not
        # yet joined the tail; without it the records handed out would have a gap.
        with self._replica_lock, self._lock:
            if self.image is None:
                return None, []
            return self.image, list(self._tail) + list(self._inbox)

    def wait_replayed(self, step: int, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.replayed_step >= step:
                    return True
            time.sleep(0.005)
        return False

    def replica_hash(self) -> tuple[int, str]:
        with self._replica_lock, self._lock:
            return self.replayed_step, state_hash(self.replica)

    # ------------------------------------------------------------------ persistence

    def _persist_loop(self) -> None:
        persisted_step = None
        while not self._stop.wait(0.05):
            self.flush_log()
            image = self.image
            if image is not None and image.step != persisted_step and self.durable_step != image.step:
                self._persist_now(image)
                persisted_step = image.step

    def _persist_now(self, image: Image) -> None:
        with self._persist_lock:  # one write in flight
            if self.durable_step == image.step:
                return
            self._persist_locked(image)

    def _persist_locked(self, image: Image) -> None:
        self._persist_busy = True
        start = time.perf_counter()
        try:
            tensors = unpack(image.buffer, image.layout, copy=False)
            self.store.save(image.step, tensors, {"run_id": self.job.run_id, "hf_config": self._hf_config,
                                                  "zo_config": self.zo.model_dump(mode="json")})
            self.durable_step = image.step
            self.snapshots_persisted += 1
            oldest = self.store.committed()[-1].step if self.store.committed() else None
            if oldest is not None:
                with self._log_lock:
                    self.log.collect_garbage(oldest)
        except Exception:  # a failed write leaves the previous snapshot committed; try the next one
            logger.exception("persisting the snapshot of step %d failed", image.step)
        finally:
            self.last_persist_seconds = time.perf_counter() - start
            self._persist_busy = False

    def flush_log(self) -> None:
        if self.log is None:
            return
        with self._log_lock:
            self.log.flush()

    # ------------------------------------------------------------------ reporting

    def metrics(self) -> ShadowMetrics:
        with self._lock:
            lag = self.received_step - self.replayed_step
            durable_log = self.log.durable_step if self.log is not None else None
            regime = "unknown"
            return ShadowMetrics(
                run_id=self.job.run_id, trainer_step=self.trainer_step, received_step=self.received_step,
                replayed_step=self.replayed_step, lag_steps=lag, lag_seconds=lag * self.replay_ema,
                replay_seconds_per_step=self.replay_ema, snapshot_interval=self.snapshot_interval,
                snapshot_step=self.image.step if self.image else None, durable_step=self.durable_step,
                durable_log_step=durable_log, persist_in_flight=self._persist_busy,
                last_persist_seconds=self.last_persist_seconds, snapshots_taken=self.snapshots_taken,
                snapshots_persisted=self.snapshots_persisted, resync_count=self.resync_count,
                rejected_records=self.rejected, regime=regime, source=self.source,
            )

    def close(self) -> None:
        self._stop.set()
        self._replay_thread.join(timeout=10)
        if self._persist_thread.is_alive():
            self._persist_thread.join(timeout=30)
        with self._log_lock:
            if self.log is not None:
                self.log.close()
