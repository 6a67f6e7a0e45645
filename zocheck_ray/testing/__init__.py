"""What tests, benchmarks and the demonstration use to put zocheck-ray under stress: injected faults
(`faults.py`) and the runs a recovered run must equal (`reference.py`)."""

from zocheck_ray.testing.faults import FailAt, FaultInjection, NO_FAULTS, run_with_faults
from zocheck_ray.testing.reference import uninterrupted_data_parallel_hashes, uninterrupted_hashes

__all__ = ["FailAt", "FaultInjection", "NO_FAULTS", "run_with_faults", "uninterrupted_hashes",
           "uninterrupted_data_parallel_hashes"]
