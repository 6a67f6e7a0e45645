"""QZO (maifoundations/QZO): ZO trains the quantized layers' scales alone, so they are the whole state.

    opt = ZOOptimizer(qzo_scales(base, settings), ZOConfig(lr=1e-7, eps=1e-3, grad_clip=100))
"""

from __future__ import annotations

import torch

from zocheck_ray.workload.errors import WorkloadError
from zocheck_ray.workload.quantized.load import quantized_layers
from zocheck_ray.workload.quantized.settings import QuantizationSettings

QZO_TYPE = "QZO"  # a QZO snapshot's `peft_type`: `load_qzo` loads it, peft cannot
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def qzo_scales(model: torch.nn.Module, settings: QuantizationSettings) -> list[tuple[str, torch.Tensor]]:
    """Every quantized layer's scale (live), named `<module>.<name>`, in module order."""
    if settings.double_quant:
        raise WorkloadError("peft.method=qzo trains the scales, which quantization.double_quant=true quantizes "
                            "to 8 bits; set quantization.double_quant=false")
    scales = [(f"{module}.{part}", scale) for module, part, scale in quantized_layers(model)]
    if not scales:
        raise WorkloadError("peft.method=qzo trains the scales of quantized layers, and this model has none")
    for name, scale in scales:
        if scale.dtype not in SCALE_DTYPES or not scale.is_contiguous():
            raise WorkloadError(f"QZO cannot train {name}: a {scale.dtype} tensor"
                                f"{'' if scale.is_contiguous() else ', not contiguous'} (float32, bf16 or fp16 "
                                "scales only)")
    return scales


def qzo_config(settings: QuantizationSettings, dtype: str, identity: str, base: str,
               scales: list[tuple[str, torch.Tensor]]) -> dict:
    """A QZO snapshot's `adapter_config.json`: the base's identity."""
    return {"peft_type": QZO_TYPE, "base_model_name_or_path": base, "base_identity": identity,
            "quantization": settings.model_dump(mode="json"), "dtype": dtype, "scales": len(scales)}
