"""`Lease`: one writer per run's storage.

    lease = Lease("s3://bucket/run", storage_options, owner="shadow:run-1")
    lease.acquire()                     # LeaseHeldError names a live holder
    lease.start_heartbeat()             # renews every lease_seconds / 3
    store = SnapshotStore("s3://bucket/run", storage_options, lease=lease)
    ...
    lease.release()

The lease is one JSON object per generation, `lease/gen-000000000007.json`, the highest current.
Taking it creates the next generation's object only if none exists (`Storage.create_exclusive`),
so of two racing writers one wins. A heartbeat older than `lease_seconds` is stale and the next
writer takes over; the holder counts itself lost, without I/O, once `lease_seconds` pass without
a renewal, since by then another may rightly have taken over.

What it does not promise:

- On a store that ignores `If-None-Match` two writers may create one generation; each reads it
  back, and of two exactly interleaved writes the loser learns it at its first renewal.
- Staleness compares the holder's wall clock with the reader's: they must agree to well within
  `lease_seconds`.
- A holder paused past `lease_seconds` may write once more: writes are checked against the lease
  before each destructive step, not fenced by the store.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Callable

from zocheck_ray.core import ZOCheckError
from zocheck_ray.storage.errors import StorageError
from zocheck_ray.storage.fs import Storage, open_storage

logger = logging.getLogger(__name__)

LEASE_DIR = "lease"
DEFAULT_LEASE_SECONDS = 30.0
_GENERATION = re.compile(r"^gen-(\d{12,})\.json$")


class LeaseError(ZOCheckError):
    """The single-writer lease of a run's storage is not held as the caller needs. Not a `StorageError`,
    so that a loop retrying through an outage stops on it."""


class LeaseHeldError(LeaseError):
    """Another writer holds a fresh lease; `holder` says who (owner, host, pid, age)."""

    def __init__(self, message: str, holder: "LeaseInfo | None" = None):
        super().__init__(message)
        self.holder = holder

    def __reduce__(self):
        return type(self), (str(self), self.holder)


class LeaseLostError(LeaseError):
    """The lease this writer held was taken over, released, or not renewed in time: stop writing."""


class LeaseRequiredError(LeaseError):
    """A deletion or rewrite that another writer's work may depend on was asked for without a held lease."""


def generation_name(generation: int) -> str:
    return f"{LEASE_DIR}/gen-{generation:012d}.json"


@dataclass(frozen=True)
class LeaseInfo:
    """One generation of the lease, as stored."""

    owner: str
    """Who holds it, as the holder named itself (e.g. `shadow:run-1`)."""
    token: str
    """Unique per `Lease` object: tells apart two holders of the same owner name."""
    host: str
    pid: int
    generation: int
    heartbeat_unix: float
    """The holder's wall-clock time at its last renewal."""
    lease_seconds: float
    """How long after `heartbeat_unix` the lease counts as stale."""
    released: bool = False

    def age_seconds(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.heartbeat_unix

    def stale(self, now: float | None = None) -> bool:
        """Released, or not renewed for longer than `lease_seconds`."""
        return self.released or self.age_seconds(now) > self.lease_seconds

    def describe(self, now: float | None = None) -> str:
        state = "released" if self.released else f"heartbeat {self.age_seconds(now):.1f} s ago"
        return (f"owner {self.owner!r} (host {self.host}, pid {self.pid}, generation {self.generation}, {state}, "
                f"stale after {self.lease_seconds:g} s)")

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, url: str) -> "LeaseInfo":
        try:
            doc = json.loads(data)
            return cls(owner=str(doc["owner"]), token=str(doc["token"]), host=str(doc["host"]),
                       pid=int(doc["pid"]), generation=int(doc["generation"]),
                       heartbeat_unix=float(doc["heartbeat_unix"]), lease_seconds=float(doc["lease_seconds"]),
                       released=bool(doc.get("released", False)))
        except (ValueError, KeyError, TypeError) as exc:
            raise LeaseError(f"{url} is not a lease object ({exc}); delete it if no writer is running") from exc


def read_lease(storage: Storage) -> LeaseInfo | None:
    """The current lease of the run rooted at `storage`, or None."""
    for generation in reversed(_generations(storage)):
        rel = generation_name(generation)
        try:
            data = storage.read_bytes(rel)
        except FileNotFoundError:
            continue  # removed between the listing and the read: the one below is current
        return LeaseInfo.decode(data, storage.url_of(rel))
    return None


def check_no_live_writer(url: str, storage_options: dict | None = None) -> LeaseInfo | None:
    """Raise `LeaseHeldError` naming the holder where a writer holds a fresh lease on the run at `url` (reads only);
    returns the stale or released lease found, or None."""
    try:
        storage = open_storage(url, storage_options, create=False)
    except StorageError:
        return None  # no run there yet: nothing holds it
    current = read_lease(storage)
    if current is not None and not current.stale():
        raise LeaseHeldError(
            f"another writer holds the lease of {storage.url}: {current.describe()}. One writer per run: stop that "
            f"writer, wait {current.lease_seconds:g} s after it stopped for its lease to go stale, or use another "
            "storage/run_id", current)
    return current


def release_dead_holder(url: str, storage_options: dict | None = None, *, owner: str,
                        lease_seconds: float = DEFAULT_LEASE_SECONDS) -> bool:
    """Release the lease `owner` holds on the run at `url` for a holder known dead, so the next writer need not
    wait; returns whether it released one."""
    storage = open_storage(url, storage_options, create=False)
    current = read_lease(storage)
    if current is None or current.owner != owner or current.stale():
        return False
    lease = Lease(storage, owner=owner, lease_seconds=lease_seconds)
    try:
        lease.acquire(reclaim=True)
    except LeaseHeldError:  # another owner took it meanwhile: it is theirs
        return False
    return lease.release()


def _generations(storage: Storage) -> list[int]:
    return sorted(int(m.group(1)) for name in storage.list_dir(LEASE_DIR) if (m := _GENERATION.match(name)))


class Lease:
    """The single-writer lease of the run rooted at `url` (thread-safe)."""

    def __init__(self, url: str | Storage, storage_options: dict | None = None, *, owner: str = "zocheck-ray",
                 lease_seconds: float = DEFAULT_LEASE_SECONDS):
        if not isinstance(lease_seconds, (int, float)) or isinstance(lease_seconds, bool) or not lease_seconds > 0:
            raise ValueError(f"lease_seconds must be > 0, got {lease_seconds!r}")
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"owner must be a non-empty string, got {owner!r}")
        self.storage: Storage = (open_storage(url, storage_options, create=True)
                                 if isinstance(url, (str, os.PathLike)) else url)
        self.url = self.storage.url
        self.owner = owner
        self.lease_seconds = float(lease_seconds)
        self.token = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._info: LeaseInfo | None = None       # what we hold, as last written
        self._renewed_mono = 0.0                  # monotonic time of the last successful write
        self._lost: str | None = None             # why we no longer hold it
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()
        self.last_error: str | None = None
        """The heartbeat thread's last renewal failure (None after a success)."""

    def __repr__(self) -> str:
        return f"Lease({self.url!r}, owner={self.owner!r}, generation={self.generation})"

    def __enter__(self) -> "Lease":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @property
    def heartbeat_seconds(self) -> float:
        """A third of `lease_seconds`, so one missed renewal is survived."""
        return self.lease_seconds / 3

    @property
    def info(self) -> LeaseInfo | None:
        """The lease as this holder last wrote it (None when not acquired)."""
        return self._info

    @property
    def generation(self) -> int | None:
        info = self._info
        return None if info is None else info.generation

    @property
    def held(self) -> bool:
        """Acquired, not lost or released, and renewed within `lease_seconds` (no I/O)."""
        with self._lock:
            return self._held_locked()

    def _held_locked(self) -> bool:
        return (self._info is not None and self._lost is None
                and time.monotonic() - self._renewed_mono < self.lease_seconds)

    def check(self) -> None:
        """Raise `LeaseLostError` unless the lease is held; call before a destructive write."""
        with self._lock:
            if self._held_locked():
                return
            if self._info is None and self._lost is None:
                raise LeaseRequiredError(f"the lease of {self.url} was never acquired; call acquire() first")
            reason = self._lost or (f"not renewed for {time.monotonic() - self._renewed_mono:.1f} s "
                                    f"(lease_seconds={self.lease_seconds:g}); another writer may have taken it over")
        raise LeaseLostError(f"lost the lease of {self.url} (owner {self.owner!r}): {reason}")

    # ------------------------------------------------------------------ acquire, renew, release

    def acquire(self, *, reclaim: bool = False, wait_seconds: float = 0.0) -> "Lease":
        """Take the lease: free, released, stale, or (`reclaim`) held by a dead earlier instance of `owner`.
        `wait_seconds`: keep trying that long for a fresh lease to go stale. Returns the lease itself."""
        deadline = time.monotonic() + max(0.0, wait_seconds)
        while True:
            try:
                self._try_acquire(reclaim)
                return self
            except LeaseHeldError as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                holder = exc.holder
                pause = self.heartbeat_seconds if holder is None else holder.lease_seconds - holder.age_seconds()
                time.sleep(min(max(pause, 0.01), remaining, 1.0))

    def _try_acquire(self, reclaim: bool) -> LeaseInfo:
        current = read_lease(self.storage)
        if current is not None and current.token == self.token and not current.released and self.held:
            return current  # already ours
        if current is not None and not current.stale() and current.token != self.token:
            if not (reclaim and current.owner == self.owner):
                raise self._held_error(current)
        generation = 1 if current is None else current.generation + 1
        # The clock starts before the heartbeat is taken, so the holder never counts itself
        # the holder longer than a reader would.
        written_mono = time.monotonic()
        info = self._new_info(generation)
        self.storage.make_dirs(LEASE_DIR)
        if not self.storage.create_exclusive(generation_name(generation), info.encode()):
            raise self._held_error(read_lease(self.storage), lost_race=True)
        # Read back: a store without an atomic create, or a slow writer of an older generation.
        now_current = read_lease(self.storage)
        if now_current is None or now_current.token != self.token:
            raise self._held_error(now_current, lost_race=True)
        with self._lock:
            self._info, self._lost = info, None
            self._renewed_mono = written_mono
        if current is not None and not current.released:
            how = "reclaimed from an earlier instance of the same owner" if not current.stale() else "took over"
            logger.warning("lease of %s: %s the lease of %s; now generation %d, owner %r", self.url, how,
                           current.describe(), generation, self.owner)
        else:
            logger.info("lease of %s acquired: generation %d, owner %r", self.url, generation, self.owner)
        self._remove_older(generation)
        return info

    def _held_error(self, holder: LeaseInfo | None, lost_race: bool = False) -> LeaseHeldError:
        if holder is None:
            return LeaseHeldError(f"the lease of {self.url} changed hands while it was being taken; try again")
        how = "took the lease of" if lost_race else "holds the lease of"
        return LeaseHeldError(
            f"another writer {how} {self.url}: {holder.describe()}. One writer per run: stop that writer, "
            f"wait {holder.lease_seconds:g} s after it stopped for its lease to go stale, or write to another "
            f"storage/run_id", holder)

    def renew(self) -> LeaseInfo:
        """Write a new heartbeat; `LeaseLostError` when another writer took the lease over."""
        with self._lock:
            info, lost = self._info, self._lost
        if info is None or lost is not None:
            self.check()  # raises: never acquired, released or lost
        current = read_lease(self.storage)
        if current is None or current.token != self.token or current.generation != info.generation \
                or current.released:
            reason = ("the lease object is gone" if current is None else f"it is now held by {current.describe()}")
            with self._lock:
                self._lost = reason
            raise LeaseLostError(f"lost the lease of {self.url} (owner {self.owner!r}, generation "
                                 f"{info.generation}): {reason}")
        with self._lock:
            if time.monotonic() - self._renewed_mono >= self.lease_seconds and self._lost is None:
                # Too late: a reader may have judged it stale and be taking it over right now.
                self._lost = f"not renewed for {time.monotonic() - self._renewed_mono:.1f} s"
            if self._lost is not None:
                raise LeaseLostError(f"lost the lease of {self.url} (owner {self.owner!r}): {self._lost}")
        written_mono = time.monotonic()
        fresh = self._new_info(info.generation)
        self.storage.write_atomic(generation_name(info.generation), fresh.encode())
        with self._lock:
            self._info = fresh
            self._renewed_mono = written_mono
        return fresh

    def release(self) -> bool:
        """Stop the heartbeat and mark the lease released so the next writer takes it at once; returns whether the
        stored lease says so."""
        self.stop_heartbeat()
        with self._lock:
            info, self._info = self._info, None
            was_lost = self._lost is not None
            self._lost = "released"
        if info is None or was_lost:
            return False
        try:
            current = read_lease(self.storage)
            if current is not None and current.token == self.token:
                released = LeaseInfo(**{**asdict(self._new_info(info.generation)), "released": True})
                self.storage.write_atomic(generation_name(info.generation), released.encode())
                return True
        except (StorageError, LeaseError) as exc:  # the lease then goes stale by itself
            logger.warning("could not release the lease of %s (it expires in %g s): %s", self.url,
                           self.lease_seconds, exc)
        return False

    # ------------------------------------------------------------------ heartbeat thread

    def start_heartbeat(self, on_lost: Callable[[LeaseLostError], None] | None = None) -> None:
        """Renew every `heartbeat_seconds` on a daemon thread until `release` or loss; failures are retried and kept
        in `last_error`, a loss calls `on_lost(error)` once and ends the thread."""
        self.check()
        if self._heartbeat is not None and self._heartbeat.is_alive():
            return
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._beat, args=(on_lost,), name="zocheck-lease", daemon=True)
        self._heartbeat.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        thread, self._heartbeat = self._heartbeat, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _beat(self, on_lost) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                self.renew()
                self.last_error = None
            except LeaseLostError as exc:
                self.last_error = str(exc)
                logger.error("%s", exc)
                if on_lost is not None:
                    on_lost(exc)
                return
            except (StorageError, LeaseError) as exc:  # an outage or a garbled object: the next beat retries
                self.last_error = str(exc)
                logger.warning("could not renew the lease of %s, retrying: %s", self.url, exc)

    # ------------------------------------------------------------------ storage

    def _new_info(self, generation: int) -> LeaseInfo:
        return LeaseInfo(owner=self.owner, token=self.token, host=socket.gethostname(), pid=os.getpid(),
                         generation=generation, heartbeat_unix=time.time(), lease_seconds=self.lease_seconds)

    def _remove_older(self, generation: int) -> None:
        for old in _generations(self.storage):
            if old < generation:
                try:
                    self.storage.remove(generation_name(old))
                except StorageError as exc:  # housekeeping: the next holder removes it
                    logger.warning("could not remove an old lease generation of %s: %s", self.url, exc)


def check_lease_for(lease: Lease | None, storage: Storage) -> None:
    """For a writer given `lease=`: the lease must be of the same storage root, and held."""
    if lease is None:
        return
    if not isinstance(lease, Lease):
        raise TypeError(f"lease must be a zocheck_ray.storage.Lease, got {type(lease).__name__}")
    if (lease.storage.local, getattr(lease.storage, "root", lease.url)) != (storage.local,
                                                                          getattr(storage, "root", storage.url)):
        raise ValueError(f"the lease is of {lease.url}, not of {storage.url}: pass the run's own lease")
    lease.check()


def require_lease(lease: Lease | None, storage: Storage, action: str) -> None:
    """Raise unless `lease` is held: `action` may destroy another writer's work."""
    if lease is None:
        raise LeaseRequiredError(
            f"cannot {action} under {storage.url} without the run's lease: another writer may be using it. "
            f"Open for writing with a held lease (lease = Lease(url, options).acquire(); "
            f"SnapshotStore(url, options, lease=lease), StepLog(url, options, lease=lease))")
    lease.check()
