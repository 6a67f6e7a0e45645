"""The replayable ZO core. Ray-free: runs on the trainer's device and in the shadow; its modules import only
downwards, in layers (see `backend.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zocheck_ray.core.lazy import on_first_use

if TYPE_CHECKING:
    from zocheck_ray.core.backend import perturbation
    from zocheck_ray.core.config import ZOConfig
    from zocheck_ray.core.errors import (
        CorruptRecordError,
        NonFiniteError,
        RecordSequenceError,
        StateMismatchError,
        ZOCheckError,
    )
    from zocheck_ray.core.fused import replay
    from zocheck_ray.core.hashing import state_hash
    from zocheck_ray.core.layout import EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, Layout, TensorSpec
    from zocheck_ray.core.optimizer import ZOOptimizer
    from zocheck_ray.core.record import IncompleteRecordError, StepRecord
    from zocheck_ray.core.reference import replay_reference


__getattr__, __dir__ = on_first_use(globals(), {
    "config": ("ZOConfig",), "backend": ("perturbation",), "fused": ("replay",), "hashing": ("state_hash",),
    "errors": ("CorruptRecordError", "NonFiniteError", "RecordSequenceError", "StateMismatchError", "ZOCheckError"),
    "layout": ("EXP_AVG_PREFIX", "EXP_AVG_SQ_PREFIX", "Layout", "TensorSpec"), "optimizer": ("ZOOptimizer",),
    "record": ("IncompleteRecordError", "StepRecord"), "reference": ("replay_reference",),
})
"""The names load with their modules on first use: `zocheck_ray.core.errors` alone loads neither torch nor numba."""
