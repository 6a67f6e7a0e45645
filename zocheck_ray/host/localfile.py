"""Local files for snapshots: direct I/O through aligned staging buffers, or buffered with early writeback.

    with contextlib.closing(open_local_write(path)) as f:
        f.write(data); f.flush()          # then fsync f.fileno() for durability

Direct I/O leaves no second copy of the state in the page cache, the host memory the replica lives
in. Where it is refused, each range written is handed to writeback at once.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager

logger = logging.getLogger(__name__)

WRITEBACK_BYTES = 8 << 20
"""A buffered file starts writeback after every this many bytes."""

DIRECT_ALIGN = 4096
"""Offsets, sizes and buffer addresses of direct I/O are multiples of this."""
DIRECT_BUFFER_BYTES = 2 << 20
DIRECT_BUFFERS = 4
"""Staging buffers per file: three writes in flight while the caller fills the fourth (larger writes gain nothing)."""


def open_local_write(path: str):
    """A new local file to write: a `_DirectFile`, or a `_WritebackFile` where O_DIRECT is refused (or off)."""
    from zocheck_ray.host.capabilities import capabilities

    if capabilities().direct_io:  # O_DIRECT exists here and is not turned off
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        else:
            return _DirectFile(fd)
    return _WritebackFile(path)


_staging_lock = threading.Lock()
_free_staging: list[list[mmap.mmap]] = []
_reuse_scopes = 0
_writers: ThreadPoolExecutor | None = None


def _take_staging_buffers() -> list[mmap.mmap]:
    """Page-aligned staging buffers, reused within a `staging_reuse` scope (fresh memory costs page faults)."""
    with _staging_lock:
        if _free_staging:
            return _free_staging.pop()
    return [mmap.mmap(-1, DIRECT_BUFFER_BYTES) for _ in range(DIRECT_BUFFERS)]


def _return_staging_buffers(buffers: list[mmap.mmap]) -> None:
    with _staging_lock:
        if _reuse_scopes and len(_free_staging) < 2:  # at most 2 idle sets (16 MiB) are kept
            _free_staging.append(buffers)
            return
    for b in buffers:
        b.close()


@contextmanager
def staging_reuse() -> Iterator[None]:
    """Staging buffers pass from file to file within this scope and go at its end, so they are memory only while a
    snapshot is written."""
    global _reuse_scopes
    with _staging_lock:
        _reuse_scopes += 1
    try:
        yield
    finally:
        idle: list[list[mmap.mmap]] = []
        with _staging_lock:
            _reuse_scopes -= 1
            if not _reuse_scopes:
                idle, _free_staging[:] = _free_staging[:], []
        for buffers in idle:
            for b in buffers:
                b.close()


def _direct_writers() -> ThreadPoolExecutor:
    global _writers
    with _staging_lock:
        if _writers is None:
            _writers = ThreadPoolExecutor(DIRECT_BUFFERS, thread_name_prefix="zocheck-direct-write")
        return _writers


class _DirectFile:
    """A local file written with O_DIRECT through a ring of aligned staging buffers, written by writer threads
    while the caller fills the next; a writer's error surfaces in a later call."""

    def __init__(self, fd: int):
        self._fd = fd
        self._buffers = _take_staging_buffers()
        self._pending: list[Future | None] = [None] * DIRECT_BUFFERS
        self._current = 0
        self._fill = 0
        self._written = 0  # bytes accepted from the caller
        self._on_disk = 0  # bytes handed to the writer threads (a multiple of DIRECT_ALIGN)
        self._writer = _direct_writers()
        self._finished = False
        self.closed = False

    def _write_all(self, buffer: mmap.mmap, nbytes: int, offset: int) -> None:
        view = memoryview(buffer)[:nbytes]
        done = 0
        try:
            while done < nbytes:
                done += os.pwrite(self._fd, view[done:], offset + done)
        finally:
            view.release()

    def _submit(self, nbytes: int) -> None:
        i = self._current
        self._pending[i] = self._writer.submit(self._write_all, self._buffers[i], nbytes, self._on_disk)
        self._on_disk += nbytes
        self._current = (i + 1) % DIRECT_BUFFERS
        self._fill = 0
        self._wait(self._current)  # the next buffer is free again (or its error is raised here)

    def _wait(self, i: int) -> None:
        future, self._pending[i] = self._pending[i], None
        if future is not None:
            future.result()

    def write(self, data) -> int:
        if self._finished:
            raise ValueError("write to a direct-I/O file after its flush (flush ends the file)")
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            take = min(len(view) - done, DIRECT_BUFFER_BYTES - self._fill)
            self._buffers[self._current][self._fill : self._fill + take] = view[done : done + take]
            self._fill += take
            done += take
            if self._fill == DIRECT_BUFFER_BYTES:
                self._submit(DIRECT_BUFFER_BYTES)
        self._written += done
        return done

    def tell(self) -> int:
        return self._written

    def fileno(self) -> int:
        return self._fd

    def flush(self) -> None:
        """Write out everything (the tail padded, the file truncated to its size) and wait; this ends the file."""
        if self._finished:
            return
        tail = self._fill
        if tail:
            padded = -(-tail // DIRECT_ALIGN) * DIRECT_ALIGN
            self._buffers[self._current][tail:padded] = bytes(padded - tail)
            self._submit(padded)
        for i in range(DIRECT_BUFFERS):
            self._wait(i)
        if tail:
            os.ftruncate(self._fd, self._written)
        self._finished = True

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
        finally:
            self.closed = True
            for i in range(DIRECT_BUFFERS):  # after a failure: no write may still use a buffer or the fd
                future = self._pending[i]
                if future is not None:
                    wait([future])
            os.close(self._fd)
            _return_staging_buffers(self._buffers)


class _WritebackFile:
    """A local file written unbuffered that starts writeback as it goes."""

    def __init__(self, path: str):
        self._raw = open(path, "wb", buffering=0)
        self._written = 0
        self._requested = 0  # bytes handed to writeback so far

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):  # a raw write may take fewer bytes than given
            done += self._raw.write(view[done:])
        self._written += done
        if self._written - self._requested >= WRITEBACK_BYTES:
            _start_writeback(self._raw.fileno(), self._requested, self._written - self._requested)
            self._requested = self._written
        return done

    def tell(self) -> int:
        return self._written

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        pass  # unbuffered: every byte is in the kernel already

    def close(self) -> None:
        self._raw.close()

    @property
    def closed(self) -> bool:
        return self._raw.closed


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range = None
if sys.platform.startswith("linux"):
    try:
        _sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
        _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        _sync_file_range.restype = ctypes.c_int
    except (OSError, AttributeError):
        _sync_file_range = None


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing a range to disk (a hint: failures are ignored)."""
    global _sync_file_range
    if _sync_file_range is not None and _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) != 0:
        logger.debug("sync_file_range is unavailable here (errno %d); relying on the final fsync", ctypes.get_errno())
        _sync_file_range = None
