"""`ZOConfig`: everything about the optimizer that replay needs to reproduce a step."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

JobDtype = Literal["fp32", "bf16", "fp16"]
"""The dtypes a model trains in (`JobConfig.dtype`; their torch dtypes: `core/dtypes.py`)."""

Optimizer = Literal["zo-sgd", "zo-adam", "sparse-mezo", "zo-sgd-sign", "zo-signsgd", "zo-sgd-mmt", "zo-sgd-cons"]
Perturbation = Literal["gaussian", "rademacher"]


class ZOConfig(BaseModel):
    """Zeroth-order optimizer settings, shared by the trainer and every replay."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    optimizer: Optimizer = "zo-sgd"
    """`zo-sgd` (MeZO), `zo-adam`, `sparse-mezo`, ZO-Bench's `zo-sgd-sign` (sign(g) z), `zo-sgd-mmt` and
    `zo-sgd-cons`, or `zo-signsgd` (ZO-signSGD: the elementwise sign of g z)."""
    lr: float = Field(1e-6, ge=0)
    """Learning rate; a step may carry its own (schedules), recorded with the step."""
    eps: float = Field(1e-3, gt=0)
    """Perturbation scale epsilon of the two-point gradient estimate."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay, on names without "bias", "layer_norm", "layernorm" (MeZO's rule)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """ZO-Adam moment decay rates, each in [0, 1)."""
    adam_eps: float = Field(1e-8, gt=0)
    """ZO-Adam denominator epsilon."""
    sparsity: float = Field(0.75, ge=0, lt=1)
    """Sparse-MeZO: fraction of each tensor (largest magnitudes) left unperturbed."""
    perturbation: Perturbation = "gaussian"
    """Distribution of z: standard `gaussian` or `rademacher` (+1/-1)."""
    momentum: float = 0.9
    """ZO-SGD-MMT: decay of the momentum buffer (m = momentum * m + g z), in [0, 1)."""
    num_perturbations: int = Field(1, ge=1, le=1024)
    """q: perturbations per step (n-SPSA, one seed and projected gradient each); a step costs 2q forward passes."""
    grad_clip: float | None = Field(None, gt=0)
    """Clip each projected gradient to [-grad_clip, grad_clip] before the update (QZO uses 100); None: no
    clipping."""

    @field_validator("lr", "eps", "weight_decay", "adam_eps", "sparsity", "momentum", "grad_clip")
    @classmethod
    def _finite(cls, value: float | None, info) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{info.field_name} must be finite, got {value!r}")
        return value

    @field_validator("momentum")
    @classmethod
    def _momentum(cls, value: float) -> float:
        if not 0.0 <= value < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {value!r}")
        return value

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        for i, b in enumerate(value):
            if not (math.isfinite(b) and 0.0 <= b < 1.0):
                raise ValueError(f"betas[{i}] must be in [0, 1), got {b!r}")
        return value
