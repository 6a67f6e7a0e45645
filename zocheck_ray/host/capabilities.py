"""What this host offers the Linux speed-ups, probed once per process; each has a plain path.

`ZOCHECK_HOST_PLAIN=1` turns every probe off, here and in the actors, so the plain paths are
tested on the machine that has the fast ones.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
from dataclasses import asdict, dataclass

PLAIN_ENV = "ZOCHECK_HOST_PLAIN"


@dataclass(frozen=True)
class Capabilities:
    shared_images: bool
    """Images are memfds a trainer on the node opens (else private memory, read through Ray)."""
    thread_nice: bool
    """A thread's niceness is its own (Linux), so the shadow's stages yield to trainers."""
    heap_freeze: bool
    direct_io: bool

    def as_dict(self) -> dict[str, bool]:
        return asdict(self)


def plain() -> bool:
    return os.environ.get(PLAIN_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def capabilities() -> Capabilities:
    """This process's capabilities (all absent under `ZOCHECK_HOST_PLAIN=1`)."""
    if plain():
        return Capabilities(False, False, False, False)
    return Capabilities(shared_images=_memfd(), thread_nice=_thread_nice(),
                        heap_freeze=hasattr(gc, "freeze"), direct_io=hasattr(os, "O_DIRECT"))


def _memfd() -> bool:
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


def _thread_nice() -> bool:
    """Linux: a tid names one thread for `getpriority`, so a thread's niceness is its own."""
    if not hasattr(os, "getpriority") or not os.path.isdir(f"/proc/self/task/{threading.get_native_id()}"):
        return False
    try:
        os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return True
    except OSError:
        return False
