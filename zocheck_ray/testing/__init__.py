"""What tests, benchmarks and the demonstration use to put zocheck-ray under stress: injected faults
(`faults.py`, on Ray, with what the processes inject into themselves in `injection.py`; `in_process.py`,
a trainer and a shadow in one process) and the runs a recovered run must equal (`reference.py`).

The names below load on first use: a process that unpickles a `FaultInjection` (a trainer or shadow
Ray restarts) imports `injection.py` alone, not torch or Ray's control code (see there)."""

from __future__ import annotations

import importlib

_MODULES = {
    "FailAt": "faults", "run_with_faults": "faults",
    "FaultInjection": "injection", "NO_FAULTS": "injection",
    "InProcessRun": "in_process", "run_in_process": "in_process",
    "uninterrupted_hashes": "reference", "uninterrupted_data_parallel_hashes": "reference",
}

__all__ = ["FailAt", "FaultInjection", "NO_FAULTS", "run_with_faults", "InProcessRun", "run_in_process",
           "uninterrupted_hashes", "uninterrupted_data_parallel_hashes"]


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
