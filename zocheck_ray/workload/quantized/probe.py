"""A quantized base's start-up check: installed, runnable on the device, the same bits on a second load."""

from __future__ import annotations

import json

import torch

from zocheck_ray.workload.errors import WorkloadError
from zocheck_ray.workload.names import model_directory
from zocheck_ray.workload.quantized.load import load_quantized, quantized_identity
from zocheck_ray.workload.quantized.qzo import qzo_scales
from zocheck_ray.workload.quantized.settings import QuantizationSettings, check_installed

BACKEND_ERRORS = (RuntimeError, ValueError, TypeError, NotImplementedError, ImportError, AssertionError,
                  AttributeError)  # what a backend raises for a mode it cannot run


def check_quantized(name: str, settings: QuantizationSettings, dtype: str, seed: int, qzo: bool,
                    device: str | torch.device | None) -> None:
    """`WorkloadError` in one line where the base cannot load or run (first layer, twice); `device` None: the
    installation only."""
    check_installed(settings)
    if device is None:
        return
    directory = model_directory(name)
    layers = 1 if "num_hidden_layers" in json.loads((directory / "config.json").read_text()) else None
    hashes = []
    for _ in range(2):
        try:
            model = load_quantized(directory, settings, dtype, seed, device, layers=layers)
            with torch.no_grad():
                model(input_ids=torch.arange(8, device=device).reshape(1, 8))
        except WorkloadError:
            raise
        except BACKEND_ERRORS as exc:
            line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise WorkloadError(f"{settings.describe()} with dtype {dtype} cannot run on {device}: {line}") from None
        hashes.append(quantized_identity(model, settings, dtype))
        if qzo:
            qzo_scales(model, settings)
        del model
    if hashes[0] != hashes[1]:
        raise WorkloadError(f"{settings.describe()} gave other bits on a second load on {device} (SHA-256 "
                            f"{hashes[0]}, then {hashes[1]}): no recovery of the run could be exact; choose "
                            "another backend or device")
