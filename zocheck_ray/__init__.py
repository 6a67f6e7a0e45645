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
