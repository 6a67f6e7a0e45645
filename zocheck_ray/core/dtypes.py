"""Every dtype the package names, in one table (torch dtype, recorded name, safetensors code, job name), so
that a dtype is added in one place.
"""

from __future__ import annotations

from typing import NamedTuple, get_args

import torch

from zocheck_ray.core.config import JobDtype


class Dtype(NamedTuple):
    torch: torch.dtype
    name: str
    safetensors: str
    job: str | None = None
    """`JobConfig.dtype`; None: a dtype that is stored and hashed, never trained or replayed."""


TABLE = (
    Dtype(torch.float32, "float32", "F32", "fp32"),
    Dtype(torch.bfloat16, "bfloat16", "BF16", "bf16"),
    Dtype(torch.float16, "float16", "F16", "fp16"),
    Dtype(torch.float64, "float64", "F64"),
    Dtype(torch.int64, "int64", "I64"),
    Dtype(torch.int32, "int32", "I32"),
    Dtype(torch.int16, "int16", "I16"),
    Dtype(torch.int8, "int8", "I8"),
    Dtype(torch.uint8, "uint8", "U8"),
    Dtype(torch.bool, "bool", "BOOL"),
)

TRAINED = tuple(d for d in TABLE if d.job)
"""The dtypes a model trains in and the replay kernels handle, in the kernels' code order."""
REPLAYED: dict[torch.dtype, str] = {d.torch: d.name for d in TRAINED}
JOB_DTYPES: dict[str, torch.dtype] = {d.job: d.torch for d in TRAINED}
NAMES: dict[torch.dtype, str] = {d.torch: d.name for d in TABLE}
BY_NAME: dict[str, torch.dtype] = {d.name: d.torch for d in TABLE}
SAFETENSORS: dict[torch.dtype, str] = {d.torch: d.safetensors for d in TABLE}
FROM_SAFETENSORS: dict[str, torch.dtype] = {d.safetensors: d.torch for d in TABLE}

assert get_args(JobDtype) == tuple(JOB_DTYPES), "JobDtype must list TABLE's job names, in order"
