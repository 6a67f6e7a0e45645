"""`RecordLedger`: the shadow's accepted records and its newest image, shared by its stages.

Ingest is the only writer of records (`accept`, in step order, no gaps); the replay
stage reads from its cursor and publishes images; the persistence stage reads from
the log's cursor. Each reader holds a *floor* (the oldest record it still needs):
a record is dropped once every floor has passed it. The image and its records are
read together (`recovery_view`), so a recovering trainer never sees a gap between an
image and the records after it.

All methods are thread-safe; the lock is the ledger's own and is never held while
a caller does work (replay, storage I/O).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

from zocheck_ray.core import StepRecord

REPLAY, LOG = "replay", "log"
"""The readers whose floors keep records alive."""


class RecordLedger:
    def __init__(self, next_step: int = 0, on_accept: Callable[[], None] | None = None):
        self._lock = threading.Condition()
        self._records: deque[StepRecord] = deque()
        self._first = next_step          # step of self._records[0] (when any)
        self.next_step = next_step
        """The step the next accepted record must carry (read without the lock: an int)."""
        self._floors = {REPLAY: next_step, LOG: next_step}
        self.image = None
        """The newest image (immutable; any object with `.step`), set by the replay stage."""
        self.generation_start = next_step
        """The step this generation of records starts at (the replica's step at the last reset)."""
        self.generation = 0
        """Increases on every `reset`: a reader whose cursor belongs to an older generation restarts."""
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

    def reset(self, step: int, image=None) -> None:
        """Start over at `step` (a fresh replica, or a resync past the records received): nothing older is kept."""
        with self._lock:
            self._records.clear()
            self._first = self.next_step = step
            self._floors = {REPLAY: step, LOG: step}
            self.image = image
            self.generation_start = step
            self.generation += 1
            self._lock.notify_all()

    # ------------------------------------------------------------------ readers

    def read(self, start: int, stop: int | None = None, limit: int | None = None) -> list[StepRecord]:
        """Records with `start <= step < stop`, at most `limit` of them (empty when none has arrived)."""
        with self._lock:
            if start < self._first:
                raise LookupError(f"records before step {self._first} are no longer held (asked from {start})")
            begin = start - self._first
            end = len(self._records) if stop is None else min(len(self._records), stop - self._first)
            if limit is not None:
                end = min(end, begin + limit)
            return [self._records[i] for i in range(begin, end)] if end > begin else []

    def wait_for(self, step: int, timeout: float) -> bool:
        """Wait until the record of `step - 1` has been accepted (so `next_step >= step`)."""
        with self._lock:
            return self._lock.wait_for(lambda: self.next_step >= step, timeout)

    def release(self, reader: str, step: int, image=None) -> None:
        """`reader` no longer needs records before `step`; the replay stage passes its newest image along."""
        with self._lock:
            self._floors[reader] = max(self._floors[reader], step)
            if image is not None:
                self.image = image
            floor = min(self._floors.values())
            while self._records and self._first < floor:
                self._records.popleft()
                self._first += 1
            if not self._records:
                self._first = max(self._first, min(floor, self.next_step))

    def recovery_view(self):
        """(the newest image, every accepted record after it), read together."""
        with self._lock:
            image = self.image
            if image is None:
                return None, []
            begin = image.step - self._first
            if begin < 0:  # the replay floor is the image's step, so this cannot happen
                raise LookupError(f"records from step {image.step} (the image's) are no longer held")
            return image, [self._records[i] for i in range(begin, len(self._records))]

    def __len__(self) -> int:
        return len(self._records)
