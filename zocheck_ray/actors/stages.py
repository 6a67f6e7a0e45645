"""The shadow's replay and persistence stages (see `shadow.py` for the pipeline they form).

`ReplayStage` owns the replica: it applies the ledger's records and snapshots at multiples
of N; other threads reach it only through `call`. `PersistStage` owns the snapshot store,
the step log and the run's lease: it makes records and images durable, retrying through
any storage outage, and stops for good only when another writer holds the run.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

import numpy as np
import torch

from zocheck_ray.actors.image import ImageLayout, new_buffer, pack_into, unpack
from zocheck_ray.actors.ledger import LOG, REPLAY, RecordLedger
from zocheck_ray.actors.priority import background_thread
from zocheck_ray.config import JobConfig
from zocheck_ray.core import StepRecord, replay, state_hash
from zocheck_ray.faults import FaultInjection
from zocheck_ray.storage import Lease, LeaseError, LeaseHeldError, SnapshotStore, StepLog, StorageError

logger = logging.getLogger(__name__)

MAX_REPLAY_BATCH = 64
LOG_FLUSH_SECONDS = 0.05
"""The persistence stage writes the log (and looks for a new image) at least this often."""
MAX_BACKOFF_SECONDS = 5.0
"""Retries of a failing store wait 0.1 s, 0.2 s, ... up to this."""
STARTUP_STORAGE_SECONDS = 120.0
"""How long a shadow coming back from durable storage waits for the store to answer."""


class Image:
    """An immutable copy of the replica at `step`, plus where it lives (a Ray ObjectRef, if any)."""

    def __init__(self, step: int, buffer: np.ndarray, layout: ImageLayout, handle=None):
        self.step, self.buffer, self.layout, self.handle = step, buffer, layout, handle


class StageError(RuntimeError):
    """A stage cannot go on (the message says which and why)."""


# ---------------------------------------------------------------------------------------- replay


class ReplayStage:
    """Owns the replica: applies the ledger's records, snapshots at multiples of N."""

    def __init__(self, ledger: RecordLedger, job: JobConfig, publish: Callable[[np.ndarray], object],
                 on_image: Callable[[Image], None], threads: int | None, faults: FaultInjection, nice: int = 0):
        """`nice`: the niceness of the replay thread and of the workers it starts (see `priority.py`)."""
        self.ledger = ledger
        self._nice = nice
        self.zo = job.zo
        self.threads = threads
        self.snapshot_interval = job.snapshot_interval or 16
        self._publish = publish
        self._on_image = on_image
        self._delay = faults.replay_delay_seconds
        self._stalled = faults.replay_stalled
        self.replica: dict[str, torch.Tensor] | None = None
        self.layout: ImageLayout | None = None
        self.replayed_step = 0
        self.source = "none"
        self.replay_ema = 0.0
        self.snapshots_taken = 0
        self.resync_count = 0
        self.error: str | None = None
        self.last_record: StepRecord | None = None
        self._scratch: dict[str, torch.Tensor] | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._progress = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="zocheck-replay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def call(self, fn: Callable[[], object], timeout: float | None = 300.0):
        """Run `fn` on the replay thread between batches; returns its result (or raises its error)."""
        if not self._thread.is_alive():
            return fn()  # not started yet (construction) or stopped: nobody else touches the replica
        future: Future = Future()
        self._commands.put((fn, future))
        self._wake.set()
        return future.result(timeout)

    def wait_replayed(self, step: int, timeout: float) -> bool:
        with self._progress:
            return self._progress.wait_for(lambda: self.replayed_step >= step or self.error is not None, timeout) \
                and self.replayed_step >= step

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        background_thread(self._thread.name, self._nice)
        while not self._stop.is_set():
            self._wake.wait(0.05)
            self._wake.clear()
            while not self._stop.is_set():
                self._run_commands()
                if not self._replay_batch():
                    break

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def _replay_batch(self) -> bool:
        if self.replica is None or self.error is not None or self._stalled:
            return False
        n = self.snapshot_interval
        boundary = (self.replayed_step // n + 1) * n
        batch = self.ledger.read(self.replayed_step, boundary, MAX_REPLAY_BATCH)
        if not batch:
            return False
        started = time.perf_counter()
        try:
            replay(self.replica, batch, self.zo, threads=self.threads, start_step=self.replayed_step)
        except Exception as exc:  # the replica is no longer trustworthy: only a resync repairs it
            self.error = f"replaying steps {batch[0].step}..{batch[-1].step} failed: {exc!r}"
            logger.exception("replay stage stopped")
            with self._progress:
                self._progress.notify_all()
            return False
        if self._delay:
            time.sleep(self._delay * len(batch))
        per_step = (time.perf_counter() - started) / len(batch)
        self.replay_ema = per_step if self.replay_ema == 0 else 0.8 * self.replay_ema + 0.2 * per_step
        self.last_record = batch[-1]
        with self._progress:
            self.replayed_step += len(batch)
            self._progress.notify_all()
        if self.replayed_step % n == 0:
            self._snapshot()
        return True

    def _snapshot(self) -> Image:
        buffer = pack_into(new_buffer(self.layout), self.replica, self.layout)
        image = Image(self.replayed_step, buffer, self.layout, self._publish(buffer))
        self.ledger.release(REPLAY, image.step, image)
        self.snapshots_taken += 1
        self._on_image(image)
        return image

    # ------------------------------------------------------------------ commands (run on the thread)

    def adopt(self, state: dict[str, torch.Tensor], step: int, source: str) -> Image:
        """A new replica at `step` (the ledger was reset to `step` first)."""
        self.layout = ImageLayout.of(state)
        self.replica = {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}
        self.source, self.error = source, None
        with self._progress:
            self.replayed_step = step
            self._progress.notify_all()
        return self._snapshot()

    def resync(self, state: dict[str, torch.Tensor], step: int) -> Image:
        """The trainer's state at `step` replaces the replica (caps the lag, repairs a failed replay)."""
        if self.ledger.next_step < step:  # records the shadow never got: start the ledger (and log) at `step`
            logger.warning("resync to step %d beyond the records received (%d): the log restarts there",
                           step, self.ledger.next_step)
            self.ledger.reset(step)
        for name, tensor in state.items():
            self.replica[name].copy_(tensor)
        self.resync_count += 1
        self.source, self.error = "resync", None
        with self._progress:
            self.replayed_step = step
            self._progress.notify_all()
        return self._snapshot()

    def snapshot_now(self, step: int) -> Image:
        """The image at `step` (the replica must be there), taken unless the newest one is it."""
        if self.replayed_step != step:
            raise StageError(f"the replica is at step {self.replayed_step}, not {step}")
        image = self.ledger.image
        return image if image is not None and image.step == step else self._snapshot()

    def profile_replay(self, threads: int) -> float | None:
        """Seconds to replay the newest record with `threads` threads on a scratch copy (kernel warmed)."""
        record = self.last_record
        if record is None:
            return None
        if self._scratch is None:
            self._scratch = {k: v.clone() for k, v in self.replica.items()}
        replay(self._scratch, [record], self.zo, threads=threads)  # untimed: loads the kernel for `threads`
        started = time.perf_counter()
        replay(self._scratch, [record], self.zo, threads=threads)
        return time.perf_counter() - started

    def profile_snapshot(self) -> float:
        started = time.perf_counter()
        pack_into(new_buffer(self.layout), self.replica, self.layout)
        return time.perf_counter() - started

    def end_profile(self, threads: int, snapshot_interval: int) -> None:
        self._scratch = None
        self.threads, self.snapshot_interval = threads, snapshot_interval

    def replica_hash(self) -> tuple[int, str]:
        return self.replayed_step, state_hash(self.replica)


# ---------------------------------------------------------------------------------------- persist


class PersistStage:
    """Owns the snapshot store and the step log: makes records and images durable, whatever the store does."""

    def __init__(self, ledger: RecordLedger, job: JobConfig, store: SnapshotStore, lease: Lease, meta: dict,
                 nice: int = 0):
        """`nice`: the niceness of the persistence thread and of the workers it starts (see `priority.py`)."""
        self.ledger = ledger
        self._nice = nice
        self.job = job
        self.store = store
        self.lease = lease
        self._meta = meta
        self.log: StepLog | None = None
        self._log_generation = -1
        self._log_next = 0
        self.durable_step: int | None = None
        self.durable_log_step: int | None = None
        self.snapshots_persisted = 0
        self.last_persist_seconds: float | None = None
        self.persist_in_flight = False
        self.failures = 0
        self.error: str | None = None
        self.failing_since: float | None = None
        self.stopped: str | None = None
        """Why persistence stopped for good (another writer took the run's lease), if it did."""
        self._image: Image | None = None
        self._image_lock = threading.Lock()   # the one-slot mailbox: the newest image wins
        self._seal_requested = False
        self._durable = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="zocheck-persist", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def offer(self, image: Image) -> None:
        with self._image_lock:
            if self._image is None or image.step >= self._image.step:
                self._image = image
        self._wake.set()

    def wait_durable(self, step: int, timeout: float) -> bool:
        """Wait until the image of `step` and every record before it are durable."""
        self._seal_requested = True
        self._wake.set()
        with self._durable:
            return self._durable.wait_for(lambda: self.stopped is not None
                                          or (self.durable_step == step and self._log_covers(step)), timeout) \
                and self.stopped is None

    def _log_covers(self, step: int) -> bool:
        return step == 0 or (self.durable_log_step is not None and self.durable_log_step >= step - 1) \
            or self.ledger.generation_start >= step

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        background_thread(self._thread.name, self._nice)
        backoff = 0.0
        while True:
            self._wake.wait(backoff or LOG_FLUSH_SECONDS)
            self._wake.clear()
            stopping = self._stop.is_set()
            try:
                self._persist_log(seal=stopping or self._seal_requested)
                self._persist_image()
            except LeaseError as exc:  # never retried as an outage: ours again, or stop for good
                if not self._reacquire(exc):
                    return
                backoff = min(max(2 * backoff, 0.1), MAX_BACKOFF_SECONDS)
                continue
            except Exception as exc:  # storage down, full, refusing: report, wait, try again
                self.failures += 1
                self.error = f"{type(exc).__name__}: {exc}"
                if self.failing_since is None:
                    self.failing_since = time.monotonic()
                backoff = min(max(2 * backoff, 0.1), MAX_BACKOFF_SECONDS)
                logger.warning("persistence failed (%d so far), retrying in %.1f s: %s", self.failures, backoff,
                               self.error)
                if stopping:
                    return
                continue
            backoff = 0.0
            if stopping:
                return

    def _reacquire(self, lost: LeaseError) -> bool:
        """After the lease lapsed (an outage longer than `lease_seconds`), take it again unless another
        writer holds it; False when persistence must stop for good."""
        self.failures += 1
        self.error = f"{type(lost).__name__}: {lost}"
        try:
            self.lease.acquire(reclaim=True)
            self.lease.start_heartbeat()
        except LeaseHeldError as exc:
            self.stopped = self.error = f"another writer holds the run's storage: {exc}"
            logger.error("persistence stopped: %s", self.stopped)
            with self._durable:
                self._durable.notify_all()
            return False
        except (StorageError, LeaseError) as exc:  # still unreachable: try again after the backoff
            logger.warning("the run's lease lapsed and cannot be taken again yet: %s", exc)
            return True
        logger.warning("the run's lease lapsed (%s) and was taken again: generation %s", lost, self.lease.generation)
        return True

    def _recovered(self) -> None:
        """A write went through: the outage, if any, is over (before waiters are told)."""
        if self.failing_since is not None:
            logger.info("persistence works again after %.1f s", time.monotonic() - self.failing_since)
        self.failing_since, self.error = None, None

    def _persist_log(self, seal: bool) -> None:
        if self.ledger.image is None:
            return  # no replica yet: the log opens where the first one starts
        if self.log is None or self._log_generation != self.ledger.generation:
            if self.log is not None:
                self.log.close()
                self.log = None
            generation, start = self.ledger.generation, self.ledger.generation_start
            self.log = StepLog(self.job.run_url, self.job.storage_options, seal_records=self.job.log_seal_records,
                               resume_step=start, lease=self.lease)
            self._log_generation, self._log_next = generation, start
            self._publish_log_step()
        for record in self.ledger.read(self._log_next):
            self.log.append(record)
            self._log_next = record.step + 1
        if seal:
            self.log.seal()
            self._seal_requested = False
        else:
            self.log.flush()
        self._publish_log_step()

    def _publish_log_step(self) -> None:
        durable = self.log.durable_step
        if durable is not None and durable < self.ledger.generation_start:
            durable = None  # records of an earlier generation (before a resync) say nothing of this one
        with self._durable:
            self.durable_log_step = durable
            self._recovered()
            self._durable.notify_all()
        self.ledger.release(LOG, (durable + 1) if durable is not None else self.ledger.generation_start)

    def _persist_image(self) -> None:
        with self._image_lock:
            image = self._image
        if image is None or image.step == self.durable_step:
            return
        self.persist_in_flight = True
        started = time.perf_counter()
        try:
            self.store.save(image.step, unpack(image.buffer, image.layout, copy=False), self._meta)
        finally:
            self.persist_in_flight = False
            self.last_persist_seconds = time.perf_counter() - started
        with self._image_lock:
            if self._image is image:
                self._image = None
        # Before the snapshot is reported durable, so a drained run's log is already collected.
        try:
            committed = self.store.committed()
            if committed and self.log is not None:
                self.log.collect_garbage(committed[-1].step)  # nothing below the oldest retained snapshot is needed
        except StorageError as exc:  # housekeeping: the next snapshot collects what this one left
            logger.warning("collecting the step log below the oldest retained snapshot: %s", exc)
        with self._durable:
            self.durable_step = image.step
            self.snapshots_persisted += 1
            self._recovered()
            self._durable.notify_all()
