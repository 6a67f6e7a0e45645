"""Hugging Face causal LMs built small from config (no downloads) or loaded from a directory."""

from __future__ import annotations

from pathlib import Path

import torch

SMALL_MODELS: dict[str, dict] = {
    "tiny-opt": dict(
        family="opt", vocab_size=128, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
        num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
    ),
    "tiny-llama": dict(
        family="llama", vocab_size=128, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    ),
    "tiny-qwen3": dict(
        family="qwen3", vocab_size=128, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    ),
}
"""Named small configs: real Hugging Face architectures, a few tens of thousands of parameters."""

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _config(name: str, overrides: dict | None):
    from transformers import LlamaConfig, OPTConfig, Qwen3Config

    if name not in SMALL_MODELS:
        raise ValueError(f"unknown model {name!r}; built-in small models are {sorted(SMALL_MODELS)}")
    spec = dict(SMALL_MODELS[name])
    spec.update(overrides or {})
    family = spec.pop("family")
    cls = {"opt": OPTConfig, "llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    return cls(**spec)


def model_config_dict(name: str, overrides: dict | None = None) -> dict:
    """The Hugging Face config of a named small model or a model directory, as JSON-ready dict."""
    import json

    path = Path(name)
    if name not in SMALL_MODELS and (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text())
    return _config(name, overrides).to_dict()


def build_model(name: str, dtype: str = "fp32", seed: int = 0, overrides: dict | None = None,
                device: str | torch.device = "cpu") -> torch.nn.Module:
    """A named small causal LM (see `SMALL_MODELS`) or a model directory saved by `save_pretrained`.

    Weights are initialised from `seed`, so the same call gives the same model everywhere.
    """
    from transformers import AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    torch_dtype = _DTYPES[dtype]
    path = Path(name)
    if name not in SMALL_MODELS and path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    else:
        config = _config(name, overrides)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        model = model.to(torch_dtype)
    model.eval()  # ZO uses forward passes only: no dropout
    return model.to(device)


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The canonical parameter order: `named_parameters()` order, tied weights once."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
