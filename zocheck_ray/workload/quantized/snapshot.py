"""A QZO snapshot into its quantized base, freshly loaded (LoRA's: `PeftModel.from_pretrained`).

    state = load_qzo(load_quantized("llama-dir", settings), "runs/r/snapshots/step-00000100")
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zocheck_ray.workload.adapters import BaseModelMismatchError
from zocheck_ray.workload.errors import WorkloadError
from zocheck_ray.workload.quantized.load import quantized_identity
from zocheck_ray.workload.quantized.qzo import QZO_TYPE, qzo_scales
from zocheck_ray.workload.quantized.settings import QuantizationSettings


def load_qzo(model: torch.nn.Module, directory: str | Path) -> dict[str, torch.Tensor]:
    """The snapshot's scales copied into `model`; returns the run's state. Another base is refused."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_file = directory / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"{config_file} is not readable JSON ({exc}); pass a QZO snapshot's directory") from None
    if config.get("peft_type") != QZO_TYPE:
        raise WorkloadError(f"{config_file} is a {config.get('peft_type')!r} adapter, not a QZO snapshot; load it "
                            "with peft.PeftModel.from_pretrained")
    settings = QuantizationSettings.model_validate(config["quantization"])
    mine = quantized_identity(model, settings, config["dtype"])
    if mine != config["base_identity"]:
        raise BaseModelMismatchError(
            f"the QZO snapshot {directory} trained the scales of a base with identity SHA-256 "
            f"{config['base_identity']} ({settings.describe()}, {config['dtype']}), and this model's is {mine}: "
            "load the base model directory the run used, with the same quantization, freshly")
    files = sorted(directory.glob("adapter_model*.safetensors"))
    saved = {name: t for path in files for name, t in load_file(path).items()}
    state = dict(qzo_scales(model, settings))
    if set(saved) != set(state):
        raise WorkloadError(f"{directory} holds scales {sorted(set(saved) ^ set(state))[:4]} the model lacks or "
                            "the other way round")
    with torch.no_grad():
        for name, scale in state.items():
            scale.copy_(saved[name])
    for path in sorted(directory.glob("optimizer*.safetensors")):
        state.update(load_file(path))
    return state
