"""zocheck-ray: nearly free, bit-exact checkpointing for zeroth-order fine-tuning on Ray.

The public API is re-exported here; `zocheck_ray.core` runs without Ray.
"""

import sys

try:
    from zocheck_ray.core import (
        CorruptRecordError,
        IncompleteRecordError,
        Layout,
        NonFiniteError,
        RecordSequenceError,
        StateMismatchError,
        StepRecord,
        ZOCheckError,
        ZOConfig,
        ZOOptimizer,
        perturbation,
        replay,
        replay_reference,
        state_hash,
    )
except ModuleNotFoundError as missing:
    # `python3 -m zocheck_ray ...` run by a Python without the dependencies (a `ray job submit` entrypoint on a
    # node whose Ray runs from an environment not on PATH): hand over to the Python that runs Ray there.
    if sys.argv[:1] == ["-m"]:  # only while `python -m` imports this package
        from zocheck_ray._interpreter import hand_over_to_ray_python

        hand_over_to_ray_python(missing)
    raise

__version__ = "0.1.0"

__all__ = [
    "ZOConfig", "ZOOptimizer", "StepRecord", "Layout", "perturbation", "state_hash", "replay",
    "replay_reference", "ZOCheckError", "StateMismatchError", "RecordSequenceError",
    "CorruptRecordError", "IncompleteRecordError", "NonFiniteError",
]


def __getattr__(name: str):
    # Ray-dependent parts load on first use, so `zocheck_ray.core` runs where Ray is absent.
    if name == "run":
        from zocheck_ray.control import run

        return run
    if name in ("JobConfig", "load_job_config"):
        from zocheck_ray import config

        return getattr(config, name)
    if name == "RunSummary":
        from zocheck_ray.control import RunSummary

        return RunSummary
    raise AttributeError(f"module 'zocheck_ray' has no attribute {name!r}")
