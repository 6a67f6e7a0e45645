"""A quantized frozen base (`from_pretrained(quantization_config=...)`) and its identity, hashed after every
load, so a recovery onto other bits is refused.

    base = load_quantized("llama-dir", QuantizationSettings(backend="bitsandbytes"), "fp32")
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from zocheck_ray.core.dtypes import JOB_DTYPES
from zocheck_ray.core.hashing import raw_bytes
from zocheck_ray.workload.errors import WorkloadError
from zocheck_ray.workload.quantized.settings import QuantizationSettings, check_installed

_DOMAIN = b"zocheck-ray quantized base v1\0"


def transformers_config(settings: QuantizationSettings, dtype: torch.dtype):
    """`from_pretrained`'s `quantization_config` for `settings`."""
    import transformers

    if settings.backend == "bitsandbytes":
        if settings.bits == 8:
            return transformers.BitsAndBytesConfig(load_in_8bit=True)
        return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=settings.quant_type,
                                               bnb_4bit_use_double_quant=settings.double_quant,
                                               bnb_4bit_compute_dtype=dtype)
    if settings.backend == "torchao":
        from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerAxis, PerGroup

        if settings.bits == 8:  # inductor's global settings left alone: ZO runs eagerly
            config = Int8WeightOnlyConfig(group_size=settings.group_size, set_inductor_config=False)
        else:  # the unpacked int4 layout runs on every device (Int4WeightOnlyConfig's kernels need CUDA)
            granularity = PerGroup(settings.group_size) if settings.group_size else PerAxis(0)
            config = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=granularity)
        return transformers.TorchAoConfig(config)
    return transformers.QuantoConfig(weights="int8" if settings.bits == 8 else "int4")


def load_quantized(directory: str | Path, settings: QuantizationSettings, dtype: str = "fp32", seed: int = 0,
                   device: str | torch.device = "cpu", layers: int | None = None) -> torch.nn.Module:
    """The model of `directory` quantized, in eval mode; `layers`: its first ones only (a probe)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from zocheck_ray.workload.models import model_kind

    check_installed(settings)
    directory = Path(directory)
    torch_dtype = JOB_DTYPES[dtype]
    cls = AutoModelForSequenceClassification if model_kind(str(directory)) == "sequence-classification" \
        else AutoModelForCausalLM
    extra = {} if layers is None else {"num_hidden_layers": layers}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls.from_pretrained(directory, quantization_config=transformers_config(settings, torch_dtype),
                                    dtype=torch_dtype, device_map={"": str(torch.device(device))},
                                    local_files_only=True, **extra)
    for module in model.modules():  # LLM.int8 moves its scales at the first forward: moved now, so they stay put
        weight = getattr(module, "weight", None)
        if hasattr(module, "init_8bit_state") and getattr(weight, "CB", None) is not None:
            module.init_8bit_state()
    model.eval()
    if not quantized_layers(model):
        raise WorkloadError(f"quantization ({settings.describe()}) left no layer of model {str(directory)!r} "
                            "quantized; use a model with linear layers the backend converts")
    return model


def quantized_layers(model: torch.nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(module, scale's name in it, scale) of every quantized layer, in order."""
    found = []
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is None:
            continue
        state = getattr(weight, "quant_state", None)
        if state is not None:  # bitsandbytes 4-bit: the absmax of each block
            found.append((name, "weight.absmax", state.absmax))
        elif type(weight).__name__ == "Int8Params":  # bitsandbytes LLM.int8: the absmax of each row
            found.append((name, "SCB", module.state.SCB if module.state.SCB is not None else weight.SCB))
        elif isinstance(getattr(weight, "_scale", None), torch.Tensor):  # optimum-quanto
            found.append((name, "weight._scale", weight._scale))
        elif isinstance(getattr(weight, "qdata", None), torch.Tensor) and isinstance(getattr(weight, "scale", None),
                                                                                 torch.Tensor):  # torchao
            found.append((name, "weight.scale", weight.scale))
    return found


def _plain(name: str, tensor: torch.Tensor):
    """A quantized tensor's plain parts, named."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        for part in tensor.__tensor_flatten__()[0]:
            yield from _plain(f"{name}.{part}", getattr(tensor, part))
    else:
        yield name, tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor


def quantized_identity(model: torch.nn.Module, settings: QuantizationSettings, dtype: str) -> str:
    """SHA-256 of the config, dtype and every state-dict tensor (quantized data, scales) with its name."""
    digest = hashlib.sha256(_DOMAIN)
    digest.update(json.dumps({"quantization": settings.model_dump(mode="json"), "dtype": dtype},
                             sort_keys=True).encode())
    for key, value in model.state_dict().items():
        for name, tensor in _plain(key, value):
            digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
            digest.update(raw_bytes(tensor))
    return digest.hexdigest()
