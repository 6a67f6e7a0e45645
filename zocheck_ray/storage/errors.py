"""Exceptions a caller of the storage layer may want to handle.

Every message names the URL of the store, object or segment involved and never
the credentials used to reach it.
"""

from __future__ import annotations

from typing import Sequence

from zocheck_ray.core import CorruptRecordError, ZOCheckError


class StorageError(ZOCheckError, OSError):
    """A store cannot be opened, read or written (missing, unwritable, unreachable, denied)."""


class StorageFullError(StorageError):
    """The store has no space left for a write (`ENOSPC`, or a quota's `EDQUOT`): `errno` says which and the
    message names the object being written. Freeing space there lets the next attempt through."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno

    def __reduce__(self):
        return type(self), (str(self), self.errno)


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """A file or object the caller expected does not exist."""


class StorageURLError(StorageError, ValueError):
    """A storage URL is malformed or names a scheme zocheck-ray does not support."""


class CorruptSnapshotError(StorageError):
    """A committed snapshot fails a hash or does not parse; `url` names the damaged object."""

    def __init__(self, message: str, url: str | None = None):
        super().__init__(message)
        self.url = url

    def __reduce__(self):  # keep `url` when the error crosses a process (Ray) boundary
        return type(self), (str(self), self.url)


class SnapshotNotFoundError(StorageError, LookupError):
    """No committed snapshot exists at the requested step."""


class CorruptLogError(CorruptRecordError):
    """A log segment holds a damaged record before its end, or is missing from the middle.

    `url` names the segment; `records` are the contiguous records read before the damage,
    so a recovery can still use them. `step` is the first step that cannot be read (the
    damaged record's, or the segment's first for a damaged header) and `offset` the byte of
    the segment where the damage starts, where the parser knows them.
    """

    def __init__(self, message: str, url: str | None = None, records: Sequence = (), step: int | None = None,
                 offset: int | None = None):
        super().__init__(message)
        self.url = url
        self.records = list(records)
        self.step = step
        self.offset = offset

    def __reduce__(self):
        return type(self), (str(self), self.url, self.records, self.step, self.offset)
