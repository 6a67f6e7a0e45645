"""What tests, benchmarks and the demonstration use to put zocheck-ray under stress: injected faults
(`faults.py`, on Ray, with what the processes inject into themselves in `injection.py`; `in_process.py`,
a trainer and a shadow in one process) and the runs a recovered run must equal (`reference.py`).

The names below load on first use: a process that unpickles a `FaultInjection` (a trainer or shadow
Ray restarts) imports `injection.py` alone, not torch or Ray's control code (see there)."""

from __future__ import annotations

from zocheck_ray.core.lazy import on_first_use


__getattr__, __dir__ = on_first_use(globals(), {
    "faults": ("FailAt", "FailTrialOnce", "InjectedTrialFailure", "run_with_faults"),
    "injection": ("FaultInjection", "NO_FAULTS"),
    "in_process": ("InProcessRun", "run_in_process"),
    "reference": ("uninterrupted_hashes", "uninterrupted_data_parallel_hashes"),
})
