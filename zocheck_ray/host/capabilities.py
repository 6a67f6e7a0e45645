"""What this host offers the shadow's Linux speed-ups, probed once per process.

    caps = capabilities()
    if caps.shared_images: ...          # else the plain path, which the tests also run

Each speed-up has a plain path that works anywhere Ray does: images in private memory read through
Ray, 4 KiB pages, the default niceness, an unfrozen heap, buffered writes. `ZOCHECK_HOST_PLAIN=1`
(handed to the actors through the runtime environment) turns every probe off, so the plain paths
are tested on the same machine as the fast ones.
"""

from __future__ import annotations

import functools
import gc
import mmap
import os
import threading
from dataclasses import asdict, dataclass

PLAIN_ENV = "ZOCHECK_HOST_PLAIN"
"""Set to 1: every capability reads as absent, and each speed-up takes its plain path."""


@dataclass(frozen=True)
class Capabilities:
    shared_images: bool
    """Images in memfds that a trainer on the node opens through `/proc/<pid>/fd` (else private memory, read
    through Ray)."""
    huge_pages: bool
    """`madvise(MADV_HUGEPAGE)` is accepted for the replica, the images and a trainer's skeleton."""
    thread_nice: bool
    """A thread may lower its own priority (`setpriority` on its tid), so the shadow's stages yield to trainers."""
    heap_freeze: bool
    """`gc.freeze` keeps an actor's start-up objects out of the cyclic collector's reach."""
    direct_io: bool
    """Local files may be written with O_DIRECT (each file system still answers for itself)."""

    def as_dict(self) -> dict[str, bool]:
        return asdict(self)


def plain() -> bool:
    return os.environ.get(PLAIN_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def capabilities() -> Capabilities:
    """This process's capabilities (all absent under `ZOCHECK_HOST_PLAIN=1`)."""
    if plain():
        return Capabilities(False, False, False, False, False)
    return Capabilities(shared_images=_memfd(), huge_pages=_huge_pages(), thread_nice=_thread_nice(),
                        heap_freeze=hasattr(gc, "freeze"), direct_io=hasattr(os, "O_DIRECT"))


def _memfd() -> bool:
    """A memfd can be made and opened again by path, as another process on the node would."""
    if not hasattr(os, "memfd_create"):
        return False
    try:
        fd = os.memfd_create("zocheck-probe", os.MFD_CLOEXEC)
    except OSError:  # seccomp or an old kernel
        return False
    try:
        os.close(os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDONLY))
        return True
    except OSError:  # no /proc, or it is not this process's
        return False
    finally:
        os.close(fd)


def _huge_pages() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return False
    except OSError:
        return False
    region = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
        return True
    except (AttributeError, OSError):
        return False
    finally:
        region.close()


def _thread_nice() -> bool:
    """Linux: a tid names one thread for `getpriority`, so a thread's niceness is its own."""
    if not hasattr(os, "getpriority") or not os.path.isdir(f"/proc/self/task/{threading.get_native_id()}"):
        return False
    try:
        os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return True
    except OSError:
        return False
