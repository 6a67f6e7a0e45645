"""Parameter-efficient ZO: a model wrapped with `peft`'s own classes, and what the run keeps of it.

    model = build_model("tiny-opt", "fp32", seed=0)
    identity = base_identity(model)                          # SHA-256 of the frozen base's weights
    wrapped = wrap_model(model, PeftSettings(method="lora", r=8), seed=0)
    params = adapter_parameters(wrapped)                     # what ZO perturbs and updates, peft's names

Only the adapter's parameters are trained, so the shadow's memory and the snapshots scale with
the adapter. The frozen base never travels with the state: every trainer builds it, and one whose
base hashes otherwise than the run recorded is refused.
"""

from __future__ import annotations

import inspect

import torch

from zocheck_ray.core.hashing import state_hash
from zocheck_ray.workload.errors import WorkloadError
from zocheck_ray.workload.peft_settings import PeftSettings
from zocheck_ray.workload.quantized.settings import QuantizationSettings

PROMPT_EMBEDDINGS = "prompt_embeddings"
"""What peft saves a prompt-learning adapter's virtual-token embeddings as."""


class BaseModelMismatchError(WorkloadError):
    """A trainer's frozen base model is not the one the run's adapter was trained on."""


def check_adapter(settings: PeftSettings, name: str) -> None:
    """Raise `WorkloadError`, before any actor starts, where `settings` names a LoRA target module that model `name`
    lacks, or asks for prefix tuning of a model without past key values."""
    if settings.method == "qzo" or settings.method == "lora" and not settings.target_modules:
        return  # QZO: checked on the quantized base (`workload.quantized.probe`)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from zocheck_ray.workload.models import model_config_dict, model_kind

    doc = model_config_dict(name)
    config = AutoConfig.for_model(**doc)
    encoder = model_kind(name) == "sequence-classification"
    cls = AutoModelForSequenceClassification if encoder else AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(config)
    if settings.method == "prefix":
        backbone = getattr(model, model.base_model_prefix, model)
        if encoder and not any("past_key_values" in inspect.signature(m.forward).parameters for m in (model, backbone)):
            raise WorkloadError(f"peft.method=prefix needs a model whose forward takes past key values, and model "
                                f"{name!r} ({type(model).__name__}) does not; use peft.method=lora")
        return
    names = [n for n, _ in model.named_modules()]
    for target in settings.target_modules:
        if not any(n == target or n.endswith("." + target) for n in names):
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names if n})
            raise WorkloadError(f"peft.target_modules names {target!r}, which model {name!r} does not have; "
                                f"its modules include {leaves[:40]}")


def base_identity(model: torch.nn.Module) -> str:
    """SHA-256 of the base model's weights, taken before it is wrapped."""
    return state_hash({name: p.detach() for name, p in model.named_parameters()})


def wrap_model(model: torch.nn.Module, settings: PeftSettings, seed: int, task_type: str = "CAUSAL_LM"):
    """`model` wrapped by `peft.get_peft_model` with `settings`, the adapter initialised from `seed`."""
    from peft import get_peft_model

    try:
        config = settings.config(task_type)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            wrapped = get_peft_model(model, config)
    except (ValueError, TypeError, KeyError) as exc:
        raise WorkloadError(f"peft cannot wrap this model with {settings.model_dump()}: {exc}; "
                            "set peft.target_modules to module names the model has") from exc
    wrapped.eval()
    return wrapped


def adapter_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter's trainable parameters in order, under the names `save_pretrained` gives them."""
    from peft import get_peft_model_state_dict

    saved = get_peft_model_state_dict(model)
    by_storage = {t.data_ptr(): name for name, t in saved.items() if t.numel()}
    out = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        key = by_storage.get(param.data_ptr())
        if key is None and name.startswith("prompt_encoder.") and PROMPT_EMBEDDINGS in saved \
                and tuple(saved[PROMPT_EMBEDDINGS].shape) == tuple(param.shape):
            key = PROMPT_EMBEDDINGS  # saved as the embedding of tokens 0..n-1: the weight itself
        if key is None:
            raise WorkloadError(f"the adapter's parameter {name!r} is not among what peft saves "
                                f"({sorted(saved)}); this adapter kind cannot be checkpointed")
        out.append((key, param))
    if not out:
        raise WorkloadError("the peft model has no trainable parameters")
    return out


def adapter_config(model) -> dict:
    """The adapter's config as `adapter_config.json` holds it."""
    import json

    config = model.peft_config["default"]
    doc = config.to_dict()
    return json.loads(json.dumps(doc, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


class TrainableModel:
    """A trainer's model: the module, the parameters ZO trains and, with an adapter, the base's and adapter's
    identity."""

    def __init__(self, model: torch.nn.Module, parameters: list[tuple[str, torch.nn.Parameter]],
                 base_hash: str | None = None, adapter_config: dict | None = None):
        self.model, self.parameters, self.base_hash, self.adapter_config = model, parameters, base_hash, adapter_config


def build_trainable(name: str, dtype: str, seed: int, peft: PeftSettings | None = None,
                    device: str | torch.device = "cpu", weights: str = "load",
                    quantization: QuantizationSettings | None = None) -> TrainableModel:
    """The model a trainer trains: `build_model(...)`'s, or with `peft` the base wrapped with the adapter;
    `weights="none"`: a skeleton an image fills."""
    from zocheck_ray.workload.models import build_model, model_kind, trainable_parameters
    from zocheck_ray.workload.names import model_directory

    if quantization is not None:
        return _over_quantized(name, dtype, seed, peft, quantization, device)
    if peft is None:
        model = build_model(name, dtype, seed=seed, device=device, weights=weights)
        return TrainableModel(model, trainable_parameters(model))
    base = build_model(name, dtype, seed=seed, device=device, weights="load")
    base_hash = base_identity(base)
    task_type = "SEQ_CLS" if model_kind(name) == "sequence-classification" else "CAUSAL_LM"
    wrapped = wrap_model(base, peft, seed, task_type)
    config = adapter_config(wrapped)
    directory = model_directory(name)  # what `PeftModel.from_pretrained` finds the base by, or the built-in's name
    config["base_model_name_or_path"] = str(directory.resolve()) if directory is not None else name
    return TrainableModel(wrapped, adapter_parameters(wrapped), base_hash, config)


def _over_quantized(name: str, dtype: str, seed: int, peft: PeftSettings | None, settings: QuantizationSettings,
                    device: str | torch.device) -> TrainableModel:
    """An adapter over the quantized base, or with `qzo` its scales; the base's identity hashed after the load."""
    from zocheck_ray.workload.models import model_kind
    from zocheck_ray.workload.names import model_directory
    from zocheck_ray.workload.quantized.load import load_quantized, quantized_identity
    from zocheck_ray.workload.quantized.qzo import qzo_config, qzo_scales

    directory = model_directory(name)
    if peft is None or directory is None:
        raise WorkloadError(f"quantization needs peft.method (lora, prefix or qzo) and a model directory, got "
                            f"model {name!r} and peft {peft}")
    base = load_quantized(directory, settings, dtype, seed, device)
    identity = quantized_identity(base, settings, dtype)
    where = str(directory.resolve())
    if peft.method == "qzo":
        scales = qzo_scales(base, settings)
        return TrainableModel(base, scales, identity, qzo_config(settings, dtype, identity, where, scales))
    task_type = "SEQ_CLS" if model_kind(name) == "sequence-classification" else "CAUSAL_LM"
    wrapped = wrap_model(base, peft, seed, task_type)
    config = adapter_config(wrapped)
    config["base_model_name_or_path"] = where
    return TrainableModel(wrapped, adapter_parameters(wrapped), identity, config)
