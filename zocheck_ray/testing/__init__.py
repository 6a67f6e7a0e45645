"""What tests, benchmarks and the demonstration use to put zocheck-ray under stress: injected faults
(`faults.py`, on Ray, with what the processes inject into themselves in `injection.py`; `in_process.py`,
a trainer and a shadow in one process) and the runs a recovered run must equal (`reference.py`).

The names below load on first use: a process that unpickles a `FaultInjection` (a trainer or shadow
Ray restarts) imports `injection.py` alone, not torch or Ray's control code (see there)."""

from zocheck_ray import names_on_first_use

_ON_FIRST_USE = {
    "FailAt": "zocheck_ray.testing.faults", "run_with_faults": "zocheck_ray.testing.faults",
    "FaultInjection": "zocheck_ray.testing.injection", "NO_FAULTS": "zocheck_ray.testing.injection",
    "InProcessRun": "zocheck_ray.testing.in_process", "run_in_process": "zocheck_ray.testing.in_process",
    "uninterrupted_hashes": "zocheck_ray.testing.reference",
    "uninterrupted_data_parallel_hashes": "zocheck_ray.testing.reference",
}

__all__ = list(_ON_FIRST_USE)

__getattr__, __dir__ = names_on_first_use(__name__, _ON_FIRST_USE)
