"""The CPUs this process may run on: standard library only, so that a module which must not import torch
or numba yet (`actors.trainer_process`, before it sizes numba's pool) can ask too."""

from __future__ import annotations

import os


def process_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS keeps one, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
