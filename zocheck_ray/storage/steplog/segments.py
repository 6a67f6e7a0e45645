"""Log segments: their names, their format, and how the open one reaches the store.

A segment is the 8-byte magic `ZOLOG\\0\\0\\1` followed by `StepRecord` encodings, named by its first
step. Local disk appends to `seg-N.open` (fsync'd at every flush, renamed to `seg-N.zlog` when
sealed; a crash can tear its tail, which `repair` cuts); an object store has no append, so there a
segment is uploaded whole when sealed. Each write returns the segment's `Written` once its path is
seen to hold it, so records appended to a file no path names any more never count as durable.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Protocol

from zocheck_ray.core import IncompleteRecordError, StepRecord
from zocheck_ray.core.errors import CorruptRecordError
from zocheck_ray.core.record import MAGIC as RECORD_MAGIC
from zocheck_ray.storage.errors import CorruptLogError, StorageError, StorageLostError
from zocheck_ray.storage.fs import Storage, Written

logger = logging.getLogger(__name__)

LOG_DIR = "log"
SEGMENT_MAGIC = b"ZOLOG\x00\x00\x01"
SEALED_SUFFIX = ".zlog"
OPEN_SUFFIX = ".open"
_RECORD_MAGIC = RECORD_MAGIC.to_bytes(2, "little")
_SEGMENT = re.compile(r"^seg-(\d{12,})(\.zlog|\.open)$")


def segment_name(first_step: int, sealed: bool = True) -> str:
    return f"{LOG_DIR}/seg-{first_step:012d}{SEALED_SUFFIX if sealed else OPEN_SUFFIX}"


@dataclass(frozen=True)
class Segment:
    first_step: int
    rel: str
    sealed: bool


def list_segments(storage: Storage) -> list[Segment]:
    """The log's segments in step order."""
    out = []
    for name in storage.list_dir(LOG_DIR):
        match = _SEGMENT.match(name)
        if match:
            out.append(Segment(int(match.group(1)), f"{LOG_DIR}/{name}", match.group(2) == SEALED_SUFFIX))
    return sorted(out, key=lambda s: (s.first_step, not s.sealed))


def first_logged_step(storage: Storage) -> int | None:
    """The first step of the oldest segment, or None."""
    segments = list_segments(storage)
    return segments[0].first_step if segments else None


def parse_segment(data: bytes, segment: Segment, url: str, torn_tail_ok: bool) -> tuple[list[StepRecord], int]:
    """The records of one segment and the length of its valid part; with `torn_tail_ok` a record cut short at
    the end is dropped, else it raises `CorruptLogError`."""
    records: list[StepRecord] = []
    if data[: len(SEGMENT_MAGIC)] != SEGMENT_MAGIC[: len(data)] or (len(data) < len(SEGMENT_MAGIC) and not torn_tail_ok):
        raise CorruptLogError(f"{url} is not a step-log segment (bad magic)", url, step=segment.first_step, offset=0)
    if len(data) < len(SEGMENT_MAGIC):
        return records, 0
    offset = len(SEGMENT_MAGIC)
    while offset < len(data):
        try:
            record, end = StepRecord.read_from(data, offset)
        except IncompleteRecordError as exc:
            if torn_tail_ok:
                break
            raise CorruptLogError(f"{url} ends inside a record at byte {offset} but is sealed: {exc}", url, records,
                                  step=segment.first_step + len(records), offset=offset) from exc
        except CorruptRecordError as exc:
            if torn_tail_ok and not _intact_record_after(data, offset + 1):
                # Damage with nothing intact after it, at the end of the segment being written: a write cut short.
                logger.warning("ignoring the damaged tail of %s from byte %d: %s", url, offset, exc)
                break
            raise CorruptLogError(f"{url}: corrupt record at byte {offset}: {exc}", url, records,
                                  step=segment.first_step + len(records), offset=offset) from exc
        expected = segment.first_step + len(records)
        if record.step != expected:
            raise CorruptLogError(f"{url}: record at byte {offset} is step {record.step}, step {expected} belongs "
                                  "there", url, records, step=expected, offset=offset)
        records.append(record)
        offset = end
    return records, offset


def _intact_record_after(data: bytes, start: int) -> bool:
    """Whether a record with a valid CRC starts anywhere at or after `start`."""
    position = data.find(_RECORD_MAGIC, start)
    while position != -1:
        try:
            StepRecord.read_from(data, position)
            return True
        except CorruptRecordError:
            position = data.find(_RECORD_MAGIC, position + 1)
    return False


# ---------------------------------------------------------------------- writing


class SegmentWriter(Protocol):
    """How a log's open segment reaches its store; `data` is whole records. `append` and `seal` return the
    segment's `Written`, seen at its path (else `StorageLostError`)."""

    appends: bool
    """True: `append` makes records durable (local disk); False: only sealing does."""

    def append(self, first_step: int, data: bytes) -> Written:
        """Add records to the open segment that begins at `first_step`."""

    def seal(self, first_step: int, data: bytes) -> Written:
        """Add `data` and close the segment for good under its sealed name."""

    def repair(self, segment: Segment, valid_bytes: int, records: int) -> None:
        """Seal a crashed writer's open segment, cut to its first `valid_bytes` (removed if it holds no record)."""


def confirm(storage: Storage, written: Written) -> Written:
    """`written`, once its path is seen to hold it; `StorageLostError` naming the path where it does not."""
    problem = written.changed(storage.observe(written.rel))
    if problem is not None:
        url = storage.url_of(written.rel)
        raise StorageLostError(f"{url} {problem}", url)
    return written


class LocalSegmentWriter:
    """Appends to `seg-N.open`; sealing renames it to `seg-N.zlog`."""

    appends = True

    def __init__(self, storage: Storage, fsync: bool):
        self.storage = storage
        self.fsync = fsync
        self._file = None       # the open segment, once appended to
        self._good_bytes = 0    # bytes of it known to hold whole records
        self._identity = None   # (st_dev, st_ino) of the open segment written
        self._renamed = False   # sealed under its final name, its directory not yet synced

    def append(self, first_step: int, data: bytes) -> Written:
        rel = segment_name(first_step, sealed=False)
        with self.storage.guard("append to", rel):
            if self._file is None and self._good_bytes:
                # Reopened after a failed write: continue after the last whole record (of the same file: confirmed).
                self._file = open(self.storage.local_path(rel), "r+b")
                self._file.truncate(self._good_bytes)
                self._file.seek(self._good_bytes)
            elif self._file is None:
                self._file = open(self.storage.local_path(rel), "wb")
                stat = os.fstat(self._file.fileno())
                self._identity = (stat.st_dev, stat.st_ino)
                self._file.write(SEGMENT_MAGIC)
                self._good_bytes = len(SEGMENT_MAGIC)
                self.storage.sync_dir(LOG_DIR)
            try:
                self._file.write(data)
                self._file.flush()
                if self.fsync:
                    os.fsync(self._file.fileno())
            except BaseException:
                self._rewind()  # so the retry does not leave a torn record in the middle
                raise
        self._good_bytes += len(data)
        return confirm(self.storage, Written(rel, self._good_bytes, self._identity))

    def _rewind(self) -> None:
        try:
            self._file.seek(self._good_bytes)
            self._file.truncate(self._good_bytes)
        except (OSError, ValueError):
            try:
                self._file.close()
            except (OSError, ValueError):
                pass
            self._file = None  # the next write reopens the segment and cuts it to its whole records

    def seal(self, first_step: int, data: bytes) -> Written:
        if data or not self._good_bytes:
            self.append(first_step, data)
        if self._file is not None:
            self._file.close()
            self._file = None
        if not self._renamed:  # a retry after a failed directory sync renames nothing twice
            self.storage.rename(segment_name(first_step, sealed=False), segment_name(first_step))
            self._renamed = True
        self.storage.sync_dir(LOG_DIR)
        written = Written(segment_name(first_step), self._good_bytes, self._identity)  # a rename keeps the inode
        self._good_bytes, self._identity, self._renamed = 0, None, False
        return confirm(self.storage, written)

    def repair(self, segment: Segment, valid_bytes: int, records: int) -> None:
        if not records:
            self.storage.remove(segment.rel)
        else:
            with self.storage.guard("repair", segment.rel):
                with open(self.storage.local_path(segment.rel), "r+b") as f:
                    f.truncate(valid_bytes)
                    os.fsync(f.fileno())
            self.storage.rename(segment.rel, segment_name(segment.first_step))
        self.storage.sync_dir(LOG_DIR)


class ObjectSegmentWriter:
    """Uploads each segment whole when it is sealed."""

    appends = False

    def __init__(self, storage: Storage):
        self.storage = storage

    def append(self, first_step: int, data: bytes) -> Written:
        raise StorageError(f"{self.storage.url} is an object store: a segment is uploaded whole when sealed, "
                           "never appended to")

    def seal(self, first_step: int, data: bytes) -> Written:
        return self.storage.write_atomic(segment_name(first_step), SEGMENT_MAGIC + bytes(data))

    def repair(self, segment: Segment, valid_bytes: int, records: int) -> None:
        raise StorageError(f"{self.storage.url_of(segment.rel)} is an open segment on an object store, where no "
                           "log writes one (segments are uploaded sealed); remove it if no other program wrote it")


def segment_writer(storage: Storage, fsync: bool = True) -> SegmentWriter:
    """The writer for `storage`: appending on local disk, whole uploads to an object store."""
    return LocalSegmentWriter(storage, fsync) if storage.local else ObjectSegmentWriter(storage)
