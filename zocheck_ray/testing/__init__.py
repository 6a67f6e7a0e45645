"""What tests and benchmarks use to put zocheck-ray under stress: runs with a fault plan on Ray
(`faults.py`), a trainer and a shadow in one process (`in_process.py`), and the runs a recovered
run must equal (`reference.py`)."""

from __future__ import annotations

from zocheck_ray.core.lazy import on_first_use


__getattr__, __dir__ = on_first_use(globals(), {
    "faults": ("FailTrialOnce", "InjectedTrialFailure", "run_with_faults"),
    "in_process": ("InProcessRun", "run_in_process"),
    "reference": ("uninterrupted_hashes", "uninterrupted_data_parallel_hashes"),
})
