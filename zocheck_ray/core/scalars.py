"""Host-side scalars of a step: computed once in float64, cast once to float32.

Every implementation (trainer, reference replay, fused kernel) takes its scalars
from here, so all three multiply by the very same float32 values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from zocheck_ray.core.config import ZOConfig
from zocheck_ray.core.errors import NonFiniteError
from zocheck_ray.core.record import StepRecord


def f32(x: float) -> float:
    """Round a float64 to the nearest float32 (as a Python float, exactly representable)."""
    with np.errstate(over="ignore"):  # overflow gives inf, which StepScalars.of reports by name
        return float(np.float32(x))


def int_power(base: float, exponent: int) -> float:
    """base**exponent by binary exponentiation: IEEE multiplies only, no libm `pow`."""
    result, factor = 1.0, base
    while exponent:
        if exponent & 1:
            result *= factor
        factor *= factor
        exponent >>= 1
    return result


@dataclass(frozen=True, slots=True)
class StepScalars:
    plus: float
    """+eps, the first and third perturbation."""
    minus: float
    """-2 eps, the second perturbation."""
    grad: float
    lr: float
    weight_decay: float
    beta1: float = 0.0
    one_minus_beta1: float = 0.0
    beta2: float = 0.0
    one_minus_beta2: float = 0.0
    bias_correction1: float = 0.0
    """1 / (1 - beta1**t), t = step + 1."""
    bias_correction2: float = 0.0
    adam_eps: float = 0.0

    @classmethod
    def of(cls, record: StepRecord, config: ZOConfig) -> "StepScalars":
        extra = {}
        if config.optimizer == "zo-adam":
            b1, b2 = config.betas
            t = record.step + 1
            extra = dict(
                beta1=f32(b1), one_minus_beta1=f32(1.0 - b1),
                beta2=f32(b2), one_minus_beta2=f32(1.0 - b2),
                bias_correction1=f32(1.0 / (1.0 - int_power(b1, t))),
                bias_correction2=f32(1.0 / (1.0 - int_power(b2, t))),
                adam_eps=f32(config.adam_eps),
            )
        scalars = cls(
            plus=f32(record.eps), minus=f32(-2.0 * record.eps),
            grad=f32(record.projected_grad), lr=f32(record.lr),
            weight_decay=f32(config.weight_decay), **extra,
        )
        for name in cls.__slots__:
            if not math.isfinite(getattr(scalars, name)):
                raise NonFiniteError(
                    f"step {record.step}: {name} overflows float32 ({getattr(scalars, name)!r})"
                )
        return scalars
