"""What tests, benchmarks and the demonstration use to put zocheck-ray under stress: injected faults
(`faults.py`, on Ray, with what the processes inject into themselves in `injection.py`; `in_process.py`,
a trainer and a shadow in one process) and the runs a recovered run must equal (`reference.py`).

The names below load on first use: a process that unpickles a `FaultInjection` (a trainer or shadow
Ray restarts) imports `injection.py` alone, not torch or Ray's control code (see there)."""

from __future__ import annotations

import importlib

_ON_FIRST_USE = {
    "FailAt": "faults", "run_with_faults": "faults",
    "FaultInjection": "injection", "NO_FAULTS": "injection",
    "InProcessRun": "in_process", "run_in_process": "in_process",
    "uninterrupted_hashes": "reference", "uninterrupted_data_parallel_hashes": "reference",
}

__all__ = list(_ON_FIRST_USE)


def __getattr__(name: str):  # the root package's mechanism, which this layer may not import (docs/architecture.md)
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_ON_FIRST_USE[name]}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
