"""CPU priority of the shadow's background work (Linux).

    background_thread("zocheck-replay", 19)   # first thing in the thread's target

Linux keeps niceness per thread and a new thread inherits its starter's, so a pipeline thread that
lowers its own first hands it to every worker it starts, while Ray's and the actor's threads keep
theirs: replay and persistence take what the trainers leave, and `metrics()` still answers.
"""

from __future__ import annotations

import os
import threading

from zocheck_ray.host.capabilities import capabilities

THREAD_NAME_BYTES = 15
"""Linux keeps 15 bytes of a thread's name (`/proc/PID/task/TID/comm`, `top -H`)."""


def background_thread(name: str, nice: int) -> None:
    """Name the calling thread for the OS and raise its niceness to at least `nice` (0: leave it), both inherited
    by the threads it starts; off Linux nothing changes."""
    tid = threading.get_native_id()
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(name[:THREAD_NAME_BYTES])
    except OSError:
        pass
    if nice > 0 and capabilities().thread_nice:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:  # on Linux a tid names one thread, not the process
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass

