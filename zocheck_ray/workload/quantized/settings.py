"""A job's `quantization:` section (torch-free: the schema loads without the backends)."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from zocheck_ray.workload.errors import WorkloadError

Backend = Literal["bitsandbytes", "torchao", "quanto"]

BACKENDS: dict[str, tuple[str, str, str]] = {  # backend -> (module, PyPI package, zocheck-ray extra)
    "bitsandbytes": ("bitsandbytes", "bitsandbytes", "bnb"),
    "torchao": ("torchao", "torchao", "torchao"),
    "quanto": ("optimum.quanto", "optimum-quanto", "quanto"),
}


class QuantizationSettings(BaseModel):
    """A job's `quantization:` section: the frozen base, loaded quantized."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Backend
    """`bitsandbytes`, `torchao` or `quanto` (optimum-quanto); extras `bnb`, `torchao`, `quanto`."""
    bits: Literal[4, 8] = 4
    """Bits per weight."""
    quant_type: Literal["nf4", "fp4"] = "nf4"
    """bitsandbytes 4-bit: the 4-bit data type."""
    double_quant: bool = False
    """bitsandbytes 4-bit: quantize the scales too (not with QZO)."""
    group_size: int | None = Field(None, ge=1)
    """torchao: weights per scale; None: one per row."""

    @model_validator(mode="after")
    def _fields_of_the_backend(self) -> "QuantizationSettings":
        bnb4 = self.backend == "bitsandbytes" and self.bits == 4
        if not bnb4 and (self.quant_type != "nf4" or self.double_quant):
            raise ValueError(f"quantization.quant_type and quantization.double_quant are bitsandbytes 4-bit "
                             f"settings; remove them for backend={self.backend} bits={self.bits}")
        if self.group_size is not None and self.backend != "torchao":
            raise ValueError(f"quantization.group_size is a torchao setting; {self.backend} chooses its own "
                             "groups: remove it")
        return self

    def describe(self) -> str:
        """One phrase for messages: `bitsandbytes 4-bit nf4`."""
        extra = f" {self.quant_type}{' double-quant' if self.double_quant else ''}" \
            if self.backend == "bitsandbytes" and self.bits == 4 else ""
        group = f" group {self.group_size}" if self.group_size else ""
        return f"{self.backend} {self.bits}-bit{extra}{group}"


def check_installed(settings: QuantizationSettings) -> None:
    """`WorkloadError` naming the extra when the backend's package is not installed."""
    module, package, extra = BACKENDS[settings.backend]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package (optimum) missing
        found = False
    if not found:
        raise WorkloadError(f"quantization.backend={settings.backend} needs the package {package}, which is not "
                            f"installed; pip install 'zocheck-ray[{extra}]'")
