"""The shadow's replay and persistence stages (`shadow.py` describes the pipeline they form).

`ReplayStage` owns the replica and the image memory; other threads reach it only through `call`.
`PersistStage` owns the snapshot store, the step log and the lease: it retries through any storage
outage (and a full disk), and stops for good where retrying cannot help: another writer holds the
run, what it made durable is gone from its path (`StorageLostError`), or the store refuses its
writes `FULL_TRIES` times in a row (`StorageRefusedError`: read-only, denied, immutable).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch

from zocheck_ray.runtime.errors import StageError  # noqa: F401  (callers catch it from here too)
from zocheck_ray.host.image import ImageBuffer, ImageLayout, anonymous_buffer, copy_state, image_memory
from zocheck_ray.runtime.ledger import LOG, RecordLedger
from zocheck_ray.host.priority import background_thread
from zocheck_ray.config import JobConfig
from zocheck_ray.core import StepRecord, ZOConfig, replay, state_hash
from zocheck_ray.core.layout import ALL_MOMENT_PREFIXES, Layout, moment_prefixes
from zocheck_ray.core.fused import default_threads
from zocheck_ray.runtime.hooks import ShadowHooks
from zocheck_ray.storage import (CorruptSnapshotError, Lease, LeaseError, LeaseHeldError, SnapshotNotFoundError,
                                 SnapshotStore, StepLog, StorageError, StorageFullError, StorageLostError,
                                 StorageRefusedError)
from zocheck_ray.storage.retention import Retention

logger = logging.getLogger(__name__)

MAX_REPLAY_BATCH = 64
COPY_HISTORY = 32
"""How many of the newest snapshot copies `ShadowMetrics.snapshot_seconds_median` is taken over."""
LOG_FLUSH_SECONDS = 0.05
"""How often, at least, persistence writes the log and looks for a new image."""
MAX_BACKOFF_SECONDS = 5.0
"""Retries of a failing store wait 0.1 s, 0.2 s, ... up to this."""
FULL_TRIES = 3
"""Writes refused in a row for lack of space, after which a caller waiting on durability is told (a full
disk seldom frees itself while a run waits; persistence itself keeps retrying); or refused for good
(`StorageRefusedError`), after which persistence stops."""
STARTUP_STORAGE_SECONDS = 120.0
"""How long a shadow coming back from durable storage waits for the store."""


class Image:
    """A frozen copy of the replica at `step`; `lent`, `pinned` and `hold` change only in the ledger, under its
    lock."""

    def __init__(self, step: int, buffer: ImageBuffer, layout: ImageLayout, token: str, hold: bool = False):
        self.step, self.buffer, self.layout, self.token = step, buffer, layout, token
        self.lent = 0
        self.read_until = 0.0
        self.pinned = False
        self.hold = hold
        """Not written over until persistence saved it (a dev evaluation's step)."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The image's tensors: views of its buffer, never written."""
        return self.layout.views(self.buffer.bytes)


class Budget:
    """The shadow's bytes of state-sized memory by purpose, and their peak (written by the replay thread only)."""

    def __init__(self):
        self.held: dict[str, int] = {"replica": 0, "image": 0, "scratch": 0}
        self.peak = 0

    def set(self, purpose: str, nbytes: int) -> None:
        self.held[purpose] = nbytes
        self.peak = max(self.peak, sum(self.held.values()))

    def add(self, purpose: str, nbytes: int) -> None:
        self.set(purpose, self.held[purpose] + nbytes)


# ---------------------------------------------------------------------------------------- replay


class ReplayStage:
    """Owns the replica and the image memory: applies the ledger's records, snapshots at multiples of N and at
    the steps `forced` names (held until durable where `hold_forced`)."""

    def __init__(self, ledger: RecordLedger, job: JobConfig, on_image: Callable[[Image], None],
                 threads: int | None, hooks: ShadowHooks, token_prefix: str = "", nice: int = 0,
                 forced: Callable[[int], int | None] = lambda step: None, hold_forced: bool = False):
        """`forced(step)`: the first step after `step` that must have its own image, or None."""
        self.ledger = ledger
        self._forced, self._hold_forced = forced, hold_forced
        self._nice = nice
        self.zo = job.zo
        self.threads = threads
        self.snapshot_interval = job.shadow.snapshot_interval or 16
        self._on_image = on_image
        self._hooks = hooks
        self._name = f"zocheck-image-{job.run_id}"
        self._tokens = (f"{token_prefix}-{i}" for i in itertools.count())
        self.replica: dict[str, torch.Tensor] | None = None
        self._replica_memory = None
        self.layout: ImageLayout | None = None
        self.intake: ImageBuffer | None = None
        """Memory a trainer writes its state into, until committed."""
        self._intake_layout: ImageLayout | None = None
        self.budget = Budget()
        self.replayed_step = 0
        self.source = "none"
        self.replay_ema = 0.0
        self.snapshots_taken = 0
        self.snapshots_deferred = 0
        self.recovery_snapshots = 0
        self.snapshot_error: str | None = None
        self.last_copy_seconds: float | None = None
        self.last_copy_bytes = 0
        self.last_copy_fresh: bool | None = None
        self.last_copy_threads: int | None = None
        self.touched_copies: collections.deque[float] = collections.deque(maxlen=COPY_HISTORY)
        """The newest copies into memory in use: one copy is a noisy sample, so their median is the figure."""
        self.resync_count = 0
        self.error: str | None = None
        self.last_record: StepRecord | None = None
        self._scratch: ProfileScratch | None = None
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
        """Run `fn` on the replay thread between batches; returns its result or raises its error."""
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
        if self.replica is None or self.error is not None or self._hooks.replay_stalled:
            return False
        if self._forced_missing():
            return False  # a forced step waits for its image: replaying on would lose that state
        n = self.snapshot_interval
        boundary = (self.replayed_step // n + 1) * n
        forced = self._forced(self.replayed_step)
        if forced is not None:
            boundary = min(boundary, forced)
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
        self._hooks.after_replay(len(batch))
        per_step = (time.perf_counter() - started) / len(batch)
        self.replay_ema = per_step if self.replay_ema == 0 else 0.8 * self.replay_ema + 0.2 * per_step
        self.last_record = batch[-1]
        with self._progress:
            self.replayed_step += len(batch)
            self._progress.notify_all()
        if self.replayed_step % n == 0 or self.replayed_step == forced:
            self._snapshot(wait=False)
        return True

    def _forced_missing(self) -> bool:
        """The replica stands at a forced step without its image: try again; whether it is still missing."""
        step = self.replayed_step
        if step == 0 or self._forced(step - 1) != step:
            return False
        image = self.ledger.image
        if image is not None and image.step == step:
            return False
        if not self.ledger.writable_now():
            return True  # persistence saves the image before (or a reader gives it back): polled again soon
        return self._snapshot(wait=False) is None and self.snapshot_error is None

    # ------------------------------------------------------------------ images

    def _snapshot(self, wait: bool) -> Image | None:
        """Copy the replica into the image memory and offer it; None when deferred (a second image would break the
        budget)."""
        kind, old = self.ledger.claim(wait=wait)
        if kind == "busy":
            self.snapshots_deferred += 1
            return None
        try:
            buffer = self._memory_for(kind, old, self.layout)
        except MemoryError as exc:
            self.snapshot_error = f"the snapshot of step {self.replayed_step} could not be taken: {exc}"
            self.ledger.unclaim(missing=self.snapshot_error)
            logger.error(self.snapshot_error)
            return None
        self.snapshot_error = None
        self._copy(self.layout.views(buffer.bytes), self.replica, fresh=old is None or buffer is not old.buffer)
        return self._offer(buffer, self.replayed_step)

    def _memory_for(self, kind: str, old: Image | None, layout: ImageLayout) -> ImageBuffer:
        """The claimed image's memory, or new memory where there is none or it is borrowed (never written again)."""
        if kind == "reuse" and old.layout == layout:
            return old.buffer
        if old is not None:
            old.buffer.close()
            self.budget.add("image", -old.buffer.nbytes)
        buffer = image_memory(layout.nbytes, self._name)
        self.budget.add("image", buffer.nbytes)
        return buffer

    def _offer(self, buffer: ImageBuffer, step: int) -> Image:
        hold = self._hold_forced and step > 0 and self._forced(step - 1) == step
        image = Image(step, buffer, self.layout, next(self._tokens), hold=hold)
        self.ledger.publish(image)
        self.snapshots_taken += 1
        self._on_image(image)
        return image

    def _copy(self, dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], fresh: bool) -> None:
        started = time.perf_counter()
        threads = self.threads or 1
        copy_state(dst, src, threads=threads)
        self.last_copy_seconds = time.perf_counter() - started
        self.last_copy_bytes = self.layout.nbytes
        self.last_copy_fresh, self.last_copy_threads = fresh, threads
        if not fresh:
            self.touched_copies.append(self.last_copy_seconds)

    # ------------------------------------------------------------------ commands (run on the thread)

    def open_intake(self, layout: ImageLayout, timeout: float = 300.0) -> ImageBuffer:
        """Memory for a trainer's state of `layout`, taken from the image's (no image is offered meanwhile)."""
        if self.intake is not None and self._intake_layout == layout:
            return self.intake  # a second request (the first writer was lost): the same memory
        if self.intake is not None:
            self.abort_intake()
        # A trainer's state replaces the replica: a held image not yet durable is given up for it.
        kind, old = self.ledger.claim(wait=True, timeout=timeout, over_hold=True)
        self.intake, self._intake_layout = self._memory_for(kind, old, layout), layout
        return self.intake

    def commit_intake(self, step: int, source: str) -> Image:
        """The intake holds the state at `step`: it becomes the replica and the newest image."""
        if self.intake is None:
            raise StageError("no intake is open: a trainer's state is written into one first")
        buffer, layout = self.intake, self._intake_layout
        self.intake = self._intake_layout = None
        return self.adopt(buffer, layout, step, source)

    def abort_intake(self) -> None:
        """Give the intake's memory back: a snapshot of the replica, where there is one."""
        if self.intake is None:
            return
        buffer, self.intake, self._intake_layout = self.intake, None, None
        if self.replica is not None and buffer.nbytes == self.layout.nbytes:
            self._copy(self.layout.views(buffer.bytes), self.replica, fresh=False)  # the intake's, not allocated for it
            self._offer(buffer, self.replayed_step)
        else:
            buffer.close()
            self.budget.add("image", -buffer.nbytes)
            self.ledger.unclaim()

    def adopt(self, buffer: ImageBuffer, layout: ImageLayout, step: int, source: str) -> Image:
        """`buffer` holds the state at `step`: the replica becomes a copy of it, and it the newest image."""
        rebuilt = self.layout != layout
        if rebuilt:
            if self.replica is not None:
                logger.warning("the state's layout changed: the replica is rebuilt")
            self.replica = self._replica_memory = None
            self.budget.set("replica", 0)
            flat, self._replica_memory = anonymous_buffer(layout.nbytes)
            self.budget.set("replica", layout.nbytes)
            self.replica, self.layout = layout.views(flat), layout
        if source != "resync":
            self.ledger.reset(step)  # a fresh or durable replica: the records start here
        else:
            if self.ledger.next_step < step:  # records the shadow never got: the ledger (and log) restart there
                logger.warning("resync to step %d beyond the records received (%d): the log restarts there",
                               step, self.ledger.next_step)
                self.ledger.reset(step)
            self.resync_count += 1
        self._copy(self.replica, layout.views(buffer.bytes), fresh=rebuilt)
        self.source, self.error = source, None
        with self._progress:
            self.replayed_step = step
            self._progress.notify_all()
        return self._offer(buffer, step)

    def snapshot_now(self, step: int) -> Image:
        """The image at `step`, where the replica is; taken unless the newest one is it."""
        if self.replayed_step != step:
            raise StageError(f"the replica is at step {self.replayed_step}, not {step}")
        image = self.ledger.image
        if image is not None and image.step == step:
            return image
        image = self._snapshot(wait=True)
        if image is None:
            raise StageError(self.snapshot_error or f"the snapshot of step {step} could not be taken")
        return image

    def snapshot_caught_up(self) -> Image | None:
        """For a recovering trainer: replay what was received, then snapshot the replica, so that the trainer copies
        a state and replays nothing; None where the replica replayed nothing past the newest image, cannot catch
        up, or the image's memory is busy. It takes every replay thread: the trainer waits for it."""
        image = self.ledger.image
        if image is None or self.replayed_step <= image.step or not self.ledger.writable_now():
            return None  # (pinned now: no catch-up whose snapshot could not be taken)
        threads = self.threads
        self.threads = max(threads or 1, default_threads())
        try:
            while self.replayed_step < self.ledger.next_step and self._replay_batch():
                pass  # (a batch ends at a snapshot boundary, and may take that snapshot)
            image = self.ledger.image
            if (self.replica is None or self.error is not None or self.replayed_step != self.ledger.next_step
                    or image is None or image.step >= self.replayed_step):
                return None
            image = self._snapshot(wait=False)
        finally:
            self.threads = threads
        if image is not None:
            self.recovery_snapshots += 1
        return image

    def profile_replay(self, threads: int) -> float | None:
        """Seconds to replay the newest record with `threads` threads on the whole replica, estimated on a scratch
        copy of part of it."""
        record = self.last_record
        if record is None:
            return None
        if self._scratch is None:
            self._scratch = ProfileScratch(self.replica, self.zo)
            self.budget.set("scratch", self._scratch.bytes)
        scratch, record = self._scratch.state, self._scratch.record_for(record)
        # the same record twice, on purpose: the step is the record's
        replay(scratch, [record], self.zo, threads=threads, start_step=record.step)  # untimed: loads the kernel
        started = time.perf_counter()
        replay(scratch, [record], self.zo, threads=threads, start_step=record.step)
        return (time.perf_counter() - started) / self._scratch.fraction

    def profile_snapshot(self) -> float:
        if self.last_copy_seconds is None:
            raise StageError("no copy between the replica and an image has been timed yet")
        return self.last_copy_seconds

    def end_profile(self, threads: int, snapshot_interval: int) -> None:
        self._scratch = None
        self.budget.set("scratch", 0)
        self.threads, self.snapshot_interval = threads, snapshot_interval

    def replica_hash(self) -> tuple[int, str]:
        return self.replayed_step, state_hash(self.replica)

    def close(self) -> None:
        """Let go of the image memory; borrowers keep what they opened."""
        image = self.ledger.image
        for buffer in (image.buffer if image is not None else None, self.intake):
            if buffer is not None:
                buffer.close()


SCRATCH_BYTES = 64 << 20
"""The most the startup profile copies of the replica."""
SCRATCH_SHARE = 32
"""Nor more than 1/32 of the state, so that the scratch stays small beside the budget of two copies."""


SCRATCH_MIN = 64 << 10
"""But 64 KiB at least: a replay's fixed cost, scaled up, would swamp a small state's profile."""


def scratch_limit(state_bytes: int) -> int:
    """The profile's scratch bytes for a state of `state_bytes`: 1/32 of it, within [64 KiB, 64 MiB]."""
    return min(SCRATCH_BYTES, max(SCRATCH_MIN, state_bytes // SCRATCH_SHARE))


class ProfileScratch:
    """A copy of the replica's leading parameters, `scratch_limit` bytes at most, to time replays on (large
    tensors cut along their first dimension, keeping their weight decay); `fraction` scales a timing up."""

    def __init__(self, replica: dict[str, torch.Tensor], zo: ZOConfig):
        moments = moment_prefixes(zo.optimizer)
        names = [n for n in replica if not n.startswith(ALL_MOMENT_PREFIXES)]
        total = sum(replica[n].numel() for n in names)
        limit = scratch_limit(sum(t.numel() * t.element_size() for t in replica.values()))
        params, taken, elements = {}, 0, 0
        for name in names:
            if taken >= limit:
                break
            t = replica[name]
            per_element = t.element_size() + 4 * len(moments)  # moments are float32
            row = max(1, t[0].numel()) if t.dim() else 1
            rows = t.shape[0] if t.dim() else 1
            keep = min(rows, (limit - taken) // (per_element * row))
            if keep == 0:
                if params:
                    break  # the limit holds: not one more row
                keep = 1  # a state whose first row is over the limit is timed on that row
            params[name] = (t[:keep] if t.dim() else t).clone()
            taken += params[name].numel() * per_element
            elements += params[name].numel()
        self.state = dict(params)
        for prefix in moments:
            for name, p in params.items():
                self.state[prefix + name] = replica[prefix + name][: p.shape[0] if p.dim() else None].clone()
        self.bytes = sum(t.numel() * t.element_size() for t in self.state.values())
        self.fraction = elements / max(total, 1)
        self._fingerprint = Layout.from_state(self.state, zo).fingerprint(zo)
        self._params = len(params)

    def record_for(self, record: StepRecord) -> StepRecord:
        return dataclasses.replace(record, fingerprint=self._fingerprint, extras=record.extras[: self._params])


# ---------------------------------------------------------------------------------------- persist


def _longer(backoff: float) -> float:
    return min(max(2 * backoff, 0.1), MAX_BACKOFF_SECONDS)



class PersistStage:
    """Owns the snapshot store, the step log and `retention.json`: makes records, images and pins durable,
    whatever the store does."""

    def __init__(self, ledger: RecordLedger, job: JobConfig, store: SnapshotStore, lease: Lease,
                 meta: Callable[[], dict], nice: int = 0, holds: Callable[[int], bool] = lambda step: False):
        """`meta()`: what the next snapshot carries besides its tensors; `holds(step)`: its snapshot is saved
        with `hold` (and always persisted)."""
        self.ledger = ledger
        self._holds = holds
        self.retention = Retention()
        """What `retention.json` says now (`load_retention`)."""
        self._wanted_retention: Retention | None = None
        self.pinned: dict[str, tuple[int, str]] = {}
        """Each pin whose snapshot is committed: its (step, URL)."""
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
        self.full_failures = 0
        """Writes refused in a row for lack of space (`StorageFullError`); 0 after any success."""
        self.refusals = 0
        """Writes refused in a row by a store that takes none (`StorageRefusedError`); 0 after any success."""
        self._failing: set[str] = set()  # "log", "image": the parts failing now (`error` is the newest's)
        self.stopped: str | None = None
        """Why persistence stopped for good, in one line (None while it goes on)."""
        self.stop_reason: str | None = None
        """`writer_lost`, `storage_lost` or `storage_refused` once stopped."""
        self.durable_interval = job.durability.durable_interval or job.shadow.snapshot_interval or 1
        """Images at multiples of this step are made durable (and a generation's first, and a drain's)."""
        self._wanted_step: int | None = None
        self._seal_requested = False
        self._retry_now = False
        self._durable = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="zocheck-persist", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """A new image is offered: the next pass persists it (the newest wins)."""
        self._wake.set()

    def wait_durable(self, step: int, timeout: float) -> bool:
        """Wait until the image of `step` and every record before it are durable; False at once where persistence
        stopped, or a write tried after the wait began was refused for lack of space with the store full already
        (`full`: `FULL_TRIES` in a row), so a drain or a stop decides within a try, not a timeout."""
        self._wanted_step = step
        self._seal_requested = True
        self._retry_now = True  # not after the backoff a full disk has built up
        self._wake.set()
        with self._durable:
            begun = self.failures  # only fullness met while waiting ends the wait: space freed before counts
            done = lambda: self.durable_step == step and self._log_covers(step) and self._wanted_retention is None
            return self._durable.wait_for(lambda: self.stopped is not None or (
                self.full and self.failures > begun) or done(), timeout) \
                and self.stopped is None and done()

    def load_retention(self) -> Retention:
        """Read `retention.json` and find its pinned snapshots (before the thread starts)."""
        self.retention = self.store.retention()
        self.pinned = self._committed_pins(self.retention, {})
        return self.retention

    def _committed_pins(self, retention: Retention, known: dict[str, tuple[int, str]]) -> dict[str, tuple[int, str]]:
        pinned = {name: at for name, at in known.items() if retention.pins.get(name) == at[0]}
        for name, step in retention.pins.items():
            if name not in pinned:
                try:
                    pinned[name] = (step, self.store.get(step).url)
                except (SnapshotNotFoundError, CorruptSnapshotError):
                    pass  # not saved yet (its save names it), or damaged
        return pinned

    def want_retention(self, retention: Retention) -> None:
        """Write `retention` before any later snapshot (so none of them prunes what it keeps)."""
        with self._durable:
            self._wanted_retention = retention if retention != self.retention else None
        self._wake.set()

    @property
    def full(self) -> bool:
        """Whether the last `FULL_TRIES` writes were refused for lack of space."""
        return self.full_failures >= FULL_TRIES

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
        # The log first in every pass, an image after it: a failing log holds up the whole pass, a failing
        # image (a full disk) only its own retries, so the log keeps its pace.
        background_thread(self._thread.name, self._nice)
        log_backoff = image_backoff = image_retry_at = 0.0
        while True:
            self._wake.wait(log_backoff or LOG_FLUSH_SECONDS)
            self._wake.clear()
            stopping = self._stop.is_set()
            log_failed = True
            try:
                self._persist_log(seal=stopping or self._seal_requested)
                log_failed, log_backoff = False, 0.0
                self._recovered("log")
                if stopping or self._retry_now or time.monotonic() >= image_retry_at:
                    self._retry_now = False
                    self._persist_retention()
                    self._persist_image()
                    image_backoff = 0.0
            except LeaseError as exc:  # never retried as an outage: ours again, or stop for good
                if not self._reacquire(exc):
                    return
                log_backoff = _longer(log_backoff)
            except StorageLostError as exc:  # what was durable is gone: writing on would report durable a hole
                with self._durable:  # nothing this writer saw durable is vouched for any more
                    self.durable_step = self.durable_log_step = None
                self._stop_for_good("storage_lost", f"{exc}; the run's storage changed under it")
                return
            except Exception as exc:  # storage down, full, refusing: report, wait, try again
                self._failed(exc, "log" if log_failed else "image")
                if self.stopped is not None:
                    return
                if log_failed:
                    log_backoff = _longer(log_backoff)
                else:
                    image_backoff = _longer(image_backoff)
                    image_retry_at = time.monotonic() + image_backoff
            if stopping:
                return

    def _failed(self, exc: Exception, part: str, error: str | None = None) -> None:
        """A write of `part` failed with `exc` (`error`: the line to report, else the exception's)."""
        self.failures += 1
        self.error = error or f"{type(exc).__name__}: {exc}"
        self._failing.add(part)
        if self.failing_since is None:
            self.failing_since = time.monotonic()
        with self._durable:
            self.full_failures = self.full_failures + 1 if isinstance(exc, StorageFullError) else 0
            self.refusals = self.refusals + 1 if isinstance(exc, StorageRefusedError) else 0
            self._durable.notify_all()
        if self.refusals >= FULL_TRIES:  # a read-only, denied or immutable store stays so until someone acts
            self._stop_for_good("storage_refused", f"the run's storage refuses its writes: {exc}")
            return
        logger.warning("persistence failed (%d so far), retrying: %s", self.failures, self.error)

    def _stop_for_good(self, reason: str, message: str) -> None:
        with self._durable:
            self.stopped = self.error = message
            self.stop_reason = reason
            self._durable.notify_all()
        logger.error("persistence stopped: %s", message)

    def _reacquire(self, lost: LeaseError) -> bool:
        """After the lease lapsed, take it again unless another writer holds it; False: stop for good."""
        try:
            self.lease.acquire(reclaim=True)
            self.lease.start_heartbeat()
        except LeaseHeldError as exc:
            self.failures += 1
            self._stop_for_good("writer_lost", f"another writer holds the run's storage: {exc}")
            return False
        except (StorageError, LeaseError) as exc:  # still unreachable, full or refusing: a failed write like any
            self._failed(exc, "log", f"{type(exc).__name__}: {exc} (meanwhile the run's lease lapsed: {lost})")
            return self.stopped is None
        self.failures += 1
        self.error = f"{type(lost).__name__}: {lost}"  # until the next pass writes the log
        self._failing.add("log")
        logger.warning("the run's lease lapsed (%s) and was taken again: generation %s", lost, self.lease.generation)
        return True

    def _recovered(self, part: str) -> None:
        """`part` ("log", or "image": a snapshot or retention.json written) went through: the outage is over once no
        part fails (a pass without an image due says nothing of the images; an image is written after the log)."""
        self._failing.discard(part)
        if part == "image":
            self._failing.clear()
        if self.error is None or self._failing:
            return
        if self.failing_since is not None:
            logger.info("persistence works again after %.1f s", time.monotonic() - self.failing_since)
        self.failing_since, self.error, self.full_failures, self.refusals = None, None, 0, 0

    def _persist_log(self, seal: bool) -> None:
        if self.ledger.image is None:
            return  # no replica yet: the log opens where the first one starts
        if self.log is None or self._log_generation != self.ledger.generation:
            if self.log is not None:
                self.log.close()
                self.log.confirm()  # what it wrote is still there: a new log would make a deleted log/ again
                self.log = None
            generation, start = self.ledger.generation, self.ledger.generation_start
            self.log = StepLog(self.job.run_url, self.job.storage_options,
                               seal_records=self.job.durability.log_seal_records,
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
        if durable is not None and durable < self.ledger.generation_start - 1:
            # An earlier generation's records say nothing of this one.
            durable = None
        with self._durable:
            self.durable_log_step = durable
            self._durable.notify_all()
        self.ledger.release(LOG, (durable + 1) if durable is not None else self.ledger.generation_start)

    def _due(self, step: int) -> bool:
        return step % self.durable_interval == 0 or step == self._wanted_step or step == self.ledger.generation_start \
            or self._holds(step)

    def _persist_retention(self) -> None:
        wanted = self._wanted_retention
        if wanted is None:
            return
        self.store.set_retention(wanted)
        self.pinned = self._committed_pins(wanted, self.pinned)  # before a waiter reads it
        with self._durable:
            self.retention = wanted
            if self._wanted_retention is wanted:
                self._wanted_retention = None
            self._recovered("image")
            self._durable.notify_all()

    def _persist_image(self) -> None:
        image = self.ledger.pin(skip_step=self.durable_step, due=self._due)  # read in place: pinned, not rewritten
        if image is None:
            return
        self.persist_in_flight = True
        started, saved = time.perf_counter(), None
        try:
            if self._log_next < image.step:  # its records arrived after this pass wrote the log: theirs first
                self._persist_log(seal=False)
            saved = self.store.save(image.step, image.tensors(), self._meta(), hold=self._holds(image.step),
                                    log_steps=self._log_promise(image.step))
        finally:
            self.ledger.unpin(image, durable=saved is not None)
            self.persist_in_flight = False
            self.last_persist_seconds = time.perf_counter() - started
        self.pinned = {**self.pinned, **{name: (step, saved.url) for name, step in self.retention.pins.items()
                                         if step == saved.step}}
        # Before the snapshot is reported durable, so a drained run's log is already collected.
        try:
            committed = self.store.committed()
            if committed and self.log is not None:
                self.log.collect_garbage(committed[-1].step)  # nothing below the oldest retained snapshot is needed
        except StorageLostError:
            raise
        except StorageError as exc:  # housekeeping: the next snapshot collects what this one left
            logger.warning("collecting the step log below the oldest retained snapshot: %s", exc)
        if self.log is not None:
            self.log.confirm()  # the records a recovery from this snapshot's predecessor replays are still there
        with self._durable:
            self.durable_step = image.step
            self.snapshots_persisted += 1
            self._recovered("image")  # before the waiters are told
            self._durable.notify_all()

    def _log_promise(self, step: int) -> tuple[int, int] | None:
        """The log's steps the snapshot of `step` promises (`Manifest.log_first_step`): those seen durable, from the
        durable snapshot before it (or this log's first step) on."""
        last = self.durable_log_step
        if last is None:
            return None
        first = self.ledger.generation_start if self.durable_step is None else \
            max(self.durable_step, self.ledger.generation_start)
        last = min(last, step - 1)
        return (first, last) if 0 <= first <= last else None
