"""Exceptions a caller of the storage layer may want to handle; messages name the URL, never the credentials."""

from __future__ import annotations

from typing import Sequence

from zocheck_ray.core import CorruptRecordError, ZOCheckError


class StorageError(ZOCheckError, OSError):
    """A store cannot be opened, read or written (missing, unwritable, unreachable, denied)."""


class StorageFullError(StorageError):
    """No space left for a write (`ENOSPC` or `EDQUOT` in `errno`); freeing space lets the next attempt through."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno

    def __reduce__(self):
        return type(self), (str(self), self.errno)


class StorageRefusedError(StorageError):
    """The store refuses a write for a reason that waiting does not mend (`EROFS`, `EACCES` or `EPERM` in `errno`);
    someone must change the store."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno

    def __reduce__(self):
        return type(self), (str(self), self.errno)


class StorageLostError(StorageError):
    """What the writer made durable is no longer where it wrote it; `url` names the first thing found lost. Writing
    on would report durable what a recovery could not read."""

    def __init__(self, message: str, url: str | None = None):
        super().__init__(message)
        self.url = url

    def __reduce__(self):
        return type(self), (str(self), self.url)


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


class RulesVersionError(StorageError):
    """A run stored under other update rules (`RULES_VERSION`) than this zocheck-ray's."""


class SnapshotNotFoundError(StorageError, LookupError):
    """No committed snapshot exists at the requested step."""


class CorruptLogError(CorruptRecordError):
    """A log segment holds a damaged record before its end, or is missing from the middle; `records` are the
    usable ones before the damage, `step` and `offset` where it starts, where known."""

    def __init__(self, message: str, url: str | None = None, records: Sequence = (), step: int | None = None,
                 offset: int | None = None):
        super().__init__(message)
        self.url = url
        self.records = list(records)
        self.step = step
        self.offset = offset

    def __reduce__(self):
        return type(self), (str(self), self.url, self.records, self.step, self.offset)
