"""Local files for snapshots: direct I/O through aligned staging buffers, or buffered with early writeback.

    with contextlib.closing(open_local_write(path)) as f:
        f.write(data); f.flush()          # then fsync f.fileno() for durability

Files are written with direct I/O (`O_DIRECT`) where the file system allows it: the
bytes go from a reused, page-aligned staging buffer to the disk, writer threads writing
full buffers while the caller fills the next. A snapshot then leaves no second copy of
the state in the page cache (the host memory the shadow's replica lives in) and costs no
page-cache allocation, which on a busy or virtualized host can take longer than the disk
itself. Where direct I/O is refused (tmpfs, some network file systems), files are written
unbuffered and each range is handed to writeback as soon as it is written
(`sync_file_range`). Either way only an fsync makes a file durable.
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
"""A buffered file asks the kernel to start writing its pages to disk after every this many bytes."""

DIRECT_ALIGN = 4096
"""Offsets, sizes and buffer addresses of direct I/O are multiples of this (any block size up to 4 KiB)."""
DIRECT_BUFFER_BYTES = 2 << 20
DIRECT_BUFFERS = 4
"""Staging buffers per file: up to three writes in flight while the caller fills the fourth. 2 MiB writes
reach the disk's bandwidth here as 4 MiB ones do (1 GiB through `open_local_write`, 1.7-2.8 GB/s either
way), in half the memory: 8 MiB a file."""


def open_local_write(path: str):
    """A new local file to write (truncated): a `_DirectFile`, or a `_WritebackFile` where O_DIRECT is refused."""
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
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
    """A set of page-aligned staging buffers, reused from an earlier file of the same `staging_reuse` scope when
    one is free (fresh memory costs page faults on first touch, on a virtualized host many times the copy)."""
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
    """Within this scope (a snapshot's files), a file's staging buffers are kept for the next file; at the end
    of the outermost scope the idle ones are let go. Outside any scope a file's buffers go with it: they are
    the writer's memory only while it writes (8 MiB a file), not a resident cost of the shadow between
    snapshots."""
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
    """A local file written with O_DIRECT through a ring of aligned staging buffers.

    `write` copies into the current buffer; a full buffer goes to the writer threads
    (several writes in flight keep the device busy) while the caller fills the next one.
    `flush` writes the tail padded to the alignment and truncates the file to its true
    size. An error of a writer thread surfaces in a later `write`, `flush` or `close`."""

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
        """Write out everything, the tail padded and the file truncated to its size, and wait.

        This ends the file: `open_write` flushes, fsyncs and closes, and nothing is
        written after a flush."""
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
    """A local file written unbuffered (no copy through a buffer) that starts writeback as it goes."""

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
    """Ask the kernel to start writing a range to disk, without waiting; a hint, so failures are ignored."""
    global _sync_file_range
    if _sync_file_range is not None and _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) != 0:
        logger.debug("sync_file_range is unavailable here (errno %d); relying on the final fsync", ctypes.get_errno())
        _sync_file_range = None
