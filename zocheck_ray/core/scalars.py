"""Host-side scalars of a step: computed once in float64, cast once to float32.

Every implementation (trainer, reference replay, fused kernel) takes its scalars
from here, so all three multiply by the very same float32 values.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from zocheck_ray.core.config import ZOConfig
from zocheck_ray.core.errors import NonFiniteError
from zocheck_ray.core.record import CONS_ASCENT, CONS_DESCENT, CONS_START, StepRecord


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
    momentum: float = 0.0
    """ZO-SGD-MMT's momentum."""
    grads: tuple[float, ...] = ()
    """Per perturbation j, g_j / q (`zo-sgd-sign`: sign(g_j) / q): the estimate is sum_j r(z_j) * grads[j]."""
    moves: tuple[float, ...] = ()
    """ZO-SGD-Cons: the factors of the update's moves, in order (lr, -2 lr, then lr or 2 lr, as the record's
    decision says); `lr` for every other optimizer."""

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
        if config.optimizer == "zo-sgd-mmt":
            extra["momentum"] = f32(config.momentum)
        q = len(record.grads)
        grads = record.grads
        if config.optimizer == "zo-sgd-sign":  # ZO-Bench's zo_sign_opt: sign(g_j) z_j / q, np.sign's 0 for g = 0
            grads = tuple(float((g > 0) - (g < 0)) for g in grads)
        moves = (f32(record.lr),)
        if config.optimizer == "zo-sgd-cons":
            last = {CONS_START: (f32(record.lr),), CONS_DESCENT: (f32(2.0 * record.lr),), CONS_ASCENT: ()}
            moves = (f32(record.lr), f32(-2.0 * record.lr), *last[record.decision])
        scalars = cls(
            plus=f32(record.eps), minus=f32(-2.0 * record.eps),
            grad=f32(grads[0] / q), lr=f32(record.lr),
            weight_decay=f32(config.weight_decay), grads=tuple(f32(g / q) for g in grads), moves=moves,
            **extra,
        )
        for name in cls.__slots__:
            values = getattr(scalars, name)
            for value in values if isinstance(values, tuple) else (values,):
                if not math.isfinite(value):
                    raise NonFiniteError(f"step {record.step}: {name} overflows float32 ({value!r})")
        return scalars

    def with_moves(self, *moves: float) -> "StepScalars":
        """The same step with other update moves (the trainer takes ZO-SGD-Cons' moves one at a time)."""
        return dataclasses.replace(self, moves=tuple(moves))
