"""zocheck-ray: nearly free, bit-exact checkpointing for zeroth-order fine-tuning on Ray.

The public API is re-exported here; `zocheck_ray.core` runs without Ray.
"""

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

__version__ = "0.1.0"

__all__ = [
    "ZOConfig", "ZOOptimizer", "StepRecord", "Layout", "perturbation", "state_hash", "replay",
    "replay_reference", "ZOCheckError", "StateMismatchError", "RecordSequenceError",
    "CorruptRecordError", "IncompleteRecordError", "NonFiniteError",
]


def __getattr__(name: str):
    # Ray-dependent parts load on first use, so `zocheck_ray.core` runs where Ray is absent.
    if name == "run":
        from zocheck_ray.controller import run

        return run
    if name in ("JobConfig", "load_job_config"):
        from zocheck_ray import config

        return getattr(config, name)
    if name == "RunSummary":
        from zocheck_ray.controller import RunSummary

        return RunSummary
    raise AttributeError(f"module 'zocheck_ray' has no attribute {name!r}")
