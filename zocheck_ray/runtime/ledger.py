"""`RecordLedger`: the shadow's accepted records and its newest image, shared by its stages.

Ingest alone writes records (in step order, no gaps); each reading stage holds a floor, the oldest
record it still needs, and a record goes once every floor has passed it. The image and its records
are read together, so a recovering trainer never sees a gap between them. The shadow writes each
image into the previous one's memory when nobody reads it, so the ledger tracks readers:
persistence pins an image, a recovering trainer borrows it, replay claims its memory, and a
`hold` keeps it until saved. The lock is never held while a caller does work.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Literal

from zocheck_ray.core import StepRecord

REPLAY, LOG = "replay", "log"
"""The readers whose floors keep records alive."""

Claim = Literal["new", "reuse", "replace", "busy"]
"""What `claim` found: no image yet (`new`), an image nobody reads (`reuse`), a borrowed one (`replace`),
or one being persisted or written (`busy`)."""


READ_SECONDS = 30.0
"""How long a borrowed image defers the next snapshots at most (a dead borrower never gives it back)."""


class NoImageError(RuntimeError):
    """The shadow holds records but no image to recover from (its snapshot failed)."""


class RecordLedger:
    def __init__(self, next_step: int = 0, on_accept: Callable[[], None] | None = None):
        self._lock = threading.Condition()
        self._records: deque[StepRecord] = deque()
        self._first = next_step          # step of self._records[0] (when any)
        self.next_step = next_step
        """The step the next accepted record must carry."""
        self._floors = {REPLAY: next_step, LOG: next_step}
        self.image = None
        """The newest image offered (any object with `.step`, `.lent`, `.pinned` and `.hold`)."""
        self._writing = False             # the image's memory is claimed: no image is offered meanwhile
        self._missing: str | None = None  # why an initialized shadow holds no image
        self.generation_start = next_step
        """The step this generation of records starts at (the replica's at the last reset)."""
        self.generation = 0
        """Increases on every `reset`: a reader of an older generation restarts."""
        self._on_accept = on_accept or (lambda: None)

    # ------------------------------------------------------------------ ingest

    def accept(self, records: list[StepRecord]) -> tuple[int, list[str]]:
        """Append the records that continue the sequence; returns (accepted, why each other was refused)."""
        accepted, refused = 0, []
        with self._lock:
            for record in records:
                if record.step != self.next_step:
                    when = "past" if record.step < self.next_step else "future"
                    refused.append(f"record of step {record.step} is from the {when}: step {self.next_step} "
                                   "is next; not applied")
                    continue
                self._records.append(record)
                self.next_step = record.step + 1
                accepted += 1
            if accepted:
                self._lock.notify_all()
        if accepted:
            self._on_accept()
        return accepted, refused

    def reset(self, step: int) -> None:
        """Start over at `step` (a fresh replica, or a resync past the records received); the image is the caller's."""
        with self._lock:
            self._records.clear()
            self._first = self.next_step = step
            self._floors = {REPLAY: step, LOG: step}
            self.generation_start = step
            self.generation += 1
            self._lock.notify_all()

    # ------------------------------------------------------------------ readers

    def read(self, start: int, stop: int | None = None, limit: int | None = None) -> list[StepRecord]:
        """Records with `start <= step < stop`, at most `limit` of them."""
        with self._lock:
            if start < self._first:
                raise LookupError(f"records before step {self._first} are no longer held (asked from {start})")
            begin = start - self._first
            end = len(self._records) if stop is None else min(len(self._records), stop - self._first)
            if limit is not None:
                end = min(end, begin + limit)
            return [self._records[i] for i in range(begin, end)] if end > begin else []

    def wait_for(self, step: int, timeout: float) -> bool:
        """Wait until `next_step >= step`."""
        with self._lock:
            return self._lock.wait_for(lambda: self.next_step >= step, timeout)

    def release(self, reader: str, step: int) -> None:
        """`reader` no longer needs records before `step`."""
        with self._lock:
            self._release(reader, step)

    def _release(self, reader: str, step: int) -> None:
        self._floors[reader] = max(self._floors[reader], step)
        floor = min(self._floors.values())
        while self._records and self._first < floor:
            self._records.popleft()
            self._first += 1
        if not self._records:
            self._first = max(self._first, min(floor, self.next_step))

    # ------------------------------------------------------------------ the image

    def publish(self, image) -> None:
        """Offer `image` (written into claimed memory); records before its step are no longer needed for replay."""
        with self._lock:
            self.image, self._writing, self._missing = image, False, None
            self._release(REPLAY, image.step)
            self._lock.notify_all()

    def claim(self, wait: bool = False, timeout: float = 300.0, over_hold: bool = False) -> tuple[Claim, object]:
        """Claim the image's memory for writing; returns what was found and the image it held. `busy` changes
        nothing; otherwise no image is offered until `publish` or `unclaim`."""
        with self._lock:
            if wait and not self._lock.wait_for(lambda: not self._busy(over_hold), timeout):
                raise TimeoutError(f"the image stayed pinned by persistence for {timeout:.0f} s")
            if self._busy(over_hold) or (not wait and self._read_now()):
                return "busy", self.image
            image, self.image, self._writing = self.image, None, True
            if image is None:
                return "new", None
            return ("replace" if image.lent else "reuse"), image

    def writable_now(self) -> bool:
        """Whether `claim(wait=False)` would find the image's memory free now (claims nothing)."""
        with self._lock:
            return not (self._busy() or self._read_now())

    def unclaim(self, missing: str | None = None) -> None:
        """The claimed memory was not published; `missing`: why no image is offered now."""
        with self._lock:
            self._writing = False
            self._missing = missing
            self._lock.notify_all()

    def _read_now(self) -> bool:
        """A borrower is reading the image: the next snapshot waits for the next boundary rather than allocate a
        third copy of the state beside it."""
        image = self.image
        return image is not None and image.lent > 0 and time.monotonic() < image.read_until

    def _busy(self, over_hold: bool = False) -> bool:
        image = self.image
        return self._writing or (image is not None and (image.pinned or (image.hold and not over_hold)))

    def pin(self, skip_step: int | None, due: Callable[[int], bool] = lambda step: True):
        """The newest image for the persistence stage, pinned until `unpin`, unless at `skip_step` or not `due`."""
        with self._lock:
            image = self.image
            if image is not None and image.step == skip_step and image.hold:
                image.hold = False  # durable already (a shadow rebuilt at that step)
                self._lock.notify_all()
            if image is None or image.step == skip_step or not due(image.step):
                return None
            image.pinned = True
            return image

    def unpin(self, image, durable: bool = False) -> None:
        """Persistence is done with `image`; `durable`: it was saved, so a `hold` on it ends."""
        with self._lock:
            image.pinned = False
            image.hold = image.hold and not durable
            self._lock.notify_all()

    def recovery_view(self, lend: bool = False, timeout: float = 300.0):
        """(the newest image, every accepted record after it), read together, waiting while the memory is written;
        `lend` marks the image borrowed until `give_back`."""
        with self._lock:
            if not self._lock.wait_for(lambda: not self._writing, timeout):
                raise TimeoutError(f"no image was offered for {timeout:.0f} s: the snapshot being written did "
                                   "not finish")
            image = self.image
            if image is None:
                if self._missing is not None:
                    raise NoImageError(self._missing)
                return None, []
            begin = image.step - self._first
            if begin < 0:  # the replay floor is the image's step, so this cannot happen
                raise LookupError(f"records from step {image.step} (the image's) are no longer held")
            if lend:
                image.lent += 1
                image.read_until = time.monotonic() + READ_SECONDS
            return image, [self._records[i] for i in range(begin, len(self._records))]

    def wait_newer(self, token: str | None, timeout: float) -> int | None:
        """Wait until an image other than `token` is offered; its step, or None after `timeout` seconds."""
        with self._lock:
            if self._lock.wait_for(lambda: self.image is not None and self.image.token != token, timeout):
                return self.image.step
            return None

    def give_back(self, token: str) -> bool:
        """A borrower is done with the image `token`; True when it was the offered image."""
        with self._lock:
            image = self.image
            if image is None or image.token != token or not image.lent:
                return False
            image.lent -= 1
            return True

    def __len__(self) -> int:
        return len(self._records)
