"""Workloads: Hugging Face models and data for ZO fine-tuning."""

from zocheck_ray.workload.models import SMALL_MODELS, build_model, trainable_parameters

__all__ = ["SMALL_MODELS", "build_model", "trainable_parameters"]
