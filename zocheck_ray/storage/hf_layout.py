"""The Hugging Face layout of a state's files: which tensors go in which safetensors file, by name.

    layout = file_layout(state)        # {"model.safetensors": {...}, "optimizer.safetensors": {...}}
    index = model_index(layout)        # model.safetensors.index.json when the model is sharded

The shards are the canonical encoding `core.hashing` hashes, so a snapshot's state hash follows
from its files, and `from_pretrained` loads the directory.
"""

from __future__ import annotations

import json
from typing import Mapping

import torch

from zocheck_ray.core.hashing import shards, split_state

MODEL_FILE = "model.safetensors"
"""The model's file when it fits one shard; else `model-00001-of-0000N.safetensors`... and `MODEL_INDEX_FILE`."""
OPTIMIZER_FILE = "optimizer.safetensors"
MODEL_INDEX_FILE = "model.safetensors.index.json"
HF_CONFIG_FILE = "config.json"
"""The Hugging Face model config, when there is one: with it `from_pretrained` loads the directory."""
ADAPTER_CONFIG_FILE = "adapter_config.json"
"""A peft adapter's config: with it and `adapter_model.safetensors`, `PeftModel.from_pretrained` loads the directory."""
ADAPTER_KIND = "adapter_model"
"""The parameters' file of an adapter, `adapter_model.safetensors`, where a model's is `model.safetensors`."""


def shard_file_names(kind: str, count: int) -> list[str]:
    """Hugging Face names of a part's shard files: `model.safetensors`, or `model-00001-of-00003.safetensors`..."""
    if count == 1:
        return [f"{kind}.safetensors"]
    return [f"{kind}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def file_layout(tensors: Mapping[str, torch.Tensor], model_kind: str = "model") -> dict[str, dict[str, torch.Tensor]]:
    """File name -> the tensors it holds, model shards first; `model_kind=ADAPTER_KIND` names the file as peft does."""
    layout: dict[str, dict[str, torch.Tensor]] = {}
    for kind, part in zip((model_kind, "optimizer"), split_state(tensors)):
        parts = shards(part)
        layout.update(zip(shard_file_names(kind, len(parts)), parts))
    return layout


def model_index(layout: Mapping[str, Mapping[str, torch.Tensor]]) -> bytes | None:
    """`model.safetensors.index.json`, with which `from_pretrained` loads sharded weights (None: not sharded)."""
    model = {name: shard for name, shard in layout.items() if name.startswith("model")}  # adapters: no index
    if len(model) < 2:
        return None
    weight_map = {t: name for name, shard in model.items() for t in shard}
    total = sum(t.numel() * t.element_size() for shard in model.values() for t in shard.values())
    return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode()
