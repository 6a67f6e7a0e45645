"""The shadow's persistence stage (`shadow.py` describes the pipeline): `PersistStage` owns the snapshot store, the
step log and the lease. It retries through any storage outage (and a full disk), and stops for good where retrying
cannot help: another writer holds the run, what it made durable is gone from its path (`StorageLostError`), or the
store refuses its writes `FULL_TRIES` times in a row (`StorageRefusedError`: read-only, denied, immutable)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from zocheck_ray.config import JobConfig
from zocheck_ray.host.priority import background_thread
from zocheck_ray.runtime.ledger import LOG, RecordLedger
from zocheck_ray.storage import (CorruptSnapshotError, Lease, LeaseError, LeaseHeldError, SnapshotNotFoundError,
                                 SnapshotStore, StepLog, StorageError, StorageFullError, StorageLostError,
                                 StorageRefusedError)
from zocheck_ray.storage.retention import Retention

logger = logging.getLogger(__name__)

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
