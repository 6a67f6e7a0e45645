"""A model's skeleton, and a Hugging Face checkpoint streamed straight into it.

A trainer's host memory should be its model plus a small constant, which `from_pretrained` breaks:
it initialises every parameter the checkpoint then overwrites, and maps the files beside them. So
`skeleton` builds the model on the meta device with uninitialised memory, as `from_pretrained`
builds it, and `load_checkpoint` reads the files straight into it.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterator

import torch

from zocheck_ray.core.dtypes import FROM_SAFETENSORS


SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
CHUNK_BYTES = 64 << 20
"""A dtype conversion's staging chunk: the most a load holds beside the parameters."""
MAX_HEADER_BYTES = 100 << 20


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded into the model (the message names the file and tensor)."""


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside go to the meta device (initialising them costs nothing)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            kind = type(module._parameters[name])
            module._parameters[name] = kind(module._parameters[name].to("meta"),
                                            requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def materialize(model: torch.nn.Module, device: str | torch.device = "cpu") -> None:
    """Give every meta parameter uninitialised memory on `device` (a tied parameter once)."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or not param.is_meta:
                continue
            real = made.get(id(param))
            if real is None:
                data = torch.empty(param.shape, dtype=param.dtype, device=device)
                real = made[id(param)] = torch.nn.Parameter(data, requires_grad=param.requires_grad)
            module._parameters[name] = real


def skeleton(build: Callable[[], torch.nn.Module], device: str | torch.device = "cpu") -> torch.nn.Module:
    """`build()` with its parameters allocated on `device` but neither initialised nor loaded."""
    with parameters_on_meta():
        model = build()
    materialize(model, device)
    return model.to(device)  # the buffers


def checkpoint_files(directory: Path) -> list[Path] | None:
    """The directory's safetensors files (one, or an index's shards), or None when it has none."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index (no weight_map): {exc}") from exc
        return [directory / name for name in dict.fromkeys(weight_map.values())]
    single = directory / SAFETENSORS_FILE
    return [single] if single.is_file() else None


def load_checkpoint(model: torch.nn.Module, files: list[Path], prefix: str = "") -> list[str]:
    """Read every tensor of `files` into `model`'s parameters and buffers of the same name (or with `prefix.`
    added or removed); returns the parameters the files lack (a new head)."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers())
    loaded: set[str] = set()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            header, data_start = _header(f, path)
            for key, entry in header.items():
                name = _match(key, targets, prefix)
                if name is None:
                    continue
                _read_tensor(f, path, key, entry, data_start, targets[name])
                loaded.add(name)
    loaded_ids = {id(targets[n]) for n in loaded}  # a tied parameter is loaded under any of its names
    return [n for n, p in model.named_parameters() if id(p) not in loaded_ids]


def _match(key: str, targets: dict, prefix: str) -> str | None:
    if key in targets:
        return key
    if prefix and f"{prefix}.{key}" in targets:
        return f"{prefix}.{key}"
    if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in targets:
        return key[len(prefix) + 1:]
    return None


def _header(f, path: Path) -> tuple[dict, int]:
    size = os.fstat(f.fileno()).st_size
    raw = f.read(8)
    if len(raw) != 8:
        raise CheckpointError(f"{path} is not a safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", raw)
    if n > min(MAX_HEADER_BYTES, size - 8):
        raise CheckpointError(f"{path} has an impossible safetensors header length {n} (file size {size})")
    try:
        header = json.loads(f.read(n))
    except ValueError as exc:
        raise CheckpointError(f"{path} has an unreadable safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has an unreadable safetensors header: not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + n


def _read_tensor(f, path: Path, key: str, entry: dict, data_start: int, target: torch.Tensor) -> None:
    try:
        dtype = FROM_SAFETENSORS[entry["dtype"]]
        shape, (begin, end) = list(entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: tensor {key!r} has an unreadable entry {entry}") from exc
    if shape != list(target.shape):
        raise CheckpointError(f"{path}: tensor {key!r} has shape {shape}, the model's is {list(target.shape)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = target.numel()
    if end - begin != numel * itemsize:
        raise CheckpointError(f"{path}: tensor {key!r} spans {end - begin} bytes, not {numel * itemsize}")
    flat = target.detach().view(-1)
    if target.device.type == "cpu" and dtype == target.dtype:
        _read_into(f, path, data_start + begin, flat.view(torch.uint8))
        return
    step = max(1, CHUNK_BYTES // itemsize)
    staging = torch.empty(min(step, numel), dtype=dtype)
    for a in range(0, numel, step):
        n = min(step, numel - a)
        _read_into(f, path, data_start + begin + a * itemsize, staging[:n].view(torch.uint8))
        flat[a: a + n].copy_(staging[:n])  # the cast `from_pretrained` makes: round to nearest even


def _read_into(f, path: Path, offset: int, out: torch.Tensor) -> None:
    view = memoryview(out.numpy())
    got = 0
    while got < len(view):
        n = os.preadv(f.fileno(), [view[got:]], offset + got)
        if n <= 0:
            raise CheckpointError(f"{path} is truncated at byte {offset + got}")
        got += n
