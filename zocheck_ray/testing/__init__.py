"""What tests, benchmarks and the demonstration use to put zocheck-ray under stress: injected faults
(`faults.py`, on Ray; `in_process.py`, a trainer and a shadow in one process) and the runs a recovered
run must equal (`reference.py`)."""

from zocheck_ray.testing.faults import FailAt, FaultInjection, NO_FAULTS, run_with_faults
from zocheck_ray.testing.in_process import InProcessRun, run_in_process
from zocheck_ray.testing.reference import uninterrupted_data_parallel_hashes, uninterrupted_hashes

__all__ = ["FailAt", "FaultInjection", "NO_FAULTS", "run_with_faults", "InProcessRun", "run_in_process",
           "uninterrupted_hashes", "uninterrupted_data_parallel_hashes"]
