"""CPU priority of the shadow's background work (Linux).

Linux keeps the nice value per thread, and a new thread starts with the nice value and
the name of the thread that started it. So a pipeline thread that lowers its own
priority before doing anything hands it to every worker it starts later (numba's and
torch's OpenMP teams, a storage client's threads), while Ray's own threads and the
threads that run the actor's methods keep theirs: on a node whose CPUs are all busy,
replay and persistence take what the trainers leave, and `metrics()` (so `zocheck-ray
status`) and the ingest of the trainers' records still answer.

numba's `omp` threading layer (its choice where TBB is not installed) gives every calling
thread a team of its own, so the replay thread's team is started by the replay thread. A
process-wide pool (the `tbb` layer) belongs to no one thread and keeps the priority of
whichever thread made it.

The nice value weighs a thread's CPU share only against threads of the same scheduling group:
where the kernel groups processes by session (autogroup), every session shares the CPUs
equally first; Ray's workers share the raylet's session. Ray starts its workers at nice 15: a nice-19 thread weighs 15 against a worker thread's 36.

    background_thread("zocheck-replay", 19)   # first thing in the thread's target
"""

from __future__ import annotations

import os
import threading

THREAD_NAME_BYTES = 15
"""Linux keeps 15 bytes of a thread's name (`/proc/PID/task/TID/comm`, `top -H`)."""


def background_thread(name: str, nice: int) -> None:
    """Name the calling thread `name` for the OS and raise its niceness to at least `nice` (0: leave it).

    Both are inherited by the threads it starts from then on. Where the OS keeps neither
    per thread (not Linux), nothing changes."""
    tid = threading.get_native_id()
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(name[:THREAD_NAME_BYTES])
    except OSError:
        pass
    if nice > 0 and hasattr(os, "setpriority"):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:  # on Linux a tid names one thread, not the process
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass

