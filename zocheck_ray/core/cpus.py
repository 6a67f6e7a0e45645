"""The CPUs this process may run on (standard library only)."""

from __future__ import annotations

import os


def process_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS keeps one, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
