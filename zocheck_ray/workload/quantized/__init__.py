"""Quantized frozen bases under a ZO-trained adapter, or their scales (QZO): docs/quantized.md."""

from zocheck_ray.workload.quantized.settings import BACKENDS, QuantizationSettings, check_installed

__all__ = ["BACKENDS", "QuantizationSettings", "check_installed"]
