"""`state_hash`: SHA-256 of a canonical state, the identity recovery is judged by.

The model and optimizer parts are cut into shards of whole tensors, each a safetensors file as a
snapshot stores it, and the hash combines the shards' digests, so a save or a load gets it in its
one pass over the bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Sequence

import torch

from zocheck_ray.core.dtypes import NAMES, SAFETENSORS

_DOMAIN = b"zocheck-ray state v2\0"
OPTIMIZER_PREFIX = "optimizer."
"""Names of optimizer state begin with this; they are stored in files of their own."""
SHARD_BYTES = 64 << 20
"""A shard closes before the tensor that would take it past this size."""
FILE_METADATA = {"format": "pt"}
"""The safetensors `__metadata__` of both files (what `transformers` expects of a PyTorch checkpoint)."""



def dtype_name(tensor: torch.Tensor, name: str) -> str:
    """The recorded name of `tensor`'s dtype (`TypeError` naming the tensor where safetensors cannot hold it)."""
    try:
        return NAMES[tensor.dtype]
    except KeyError:
        raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors snapshots do not hold; "
                        f"use one of {sorted(NAMES.values())}") from None


def split_state(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(model part, optimizer part) of a state, each in canonical order."""
    model = {n: t for n, t in state.items() if not n.startswith(OPTIMIZER_PREFIX)}
    optimizer = {n: t for n, t in state.items() if n.startswith(OPTIMIZER_PREFIX)}
    return model, optimizer


def safetensors_header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] = FILE_METADATA) -> bytes:
    """The length prefix and JSON header of the safetensors file holding `tensors` in order."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        dtype_name(t, name)
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data section to 8 bytes
    return struct.pack("<Q", len(text)) + text


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy where it is a contiguous CPU tensor."""
    if sys.byteorder != "little":  # raw bytes are stored and hashed as they lie in memory
        raise RuntimeError("zocheck-ray stores and hashes tensors little-endian; this host is big-endian")
    t = tensor.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def shards(part: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """`part` cut into shards of whole tensors in order; [] when empty."""
    out: list[dict[str, torch.Tensor]] = []
    size = 0
    for name, t in part.items():
        nbytes = t.numel() * t.element_size()
        if not out or (out[-1] and size + nbytes > SHARD_BYTES):
            out.append({})
            size = 0
        out[-1][name] = t
        size += nbytes
    return out


def file_sha256(tensors: Mapping[str, torch.Tensor], header: bytes | None = None) -> tuple[str, int]:
    """Hex SHA-256 and size of the safetensors file of `tensors`; `header`: its `safetensors_header`, if known."""
    header = safetensors_header(tensors) if header is None else header
    h = hashlib.sha256(header)
    size = len(header)
    for t in tensors.values():
        data = raw_bytes(t)
        h.update(data)  # hashlib releases the GIL
        size += len(data)
    return h.hexdigest(), size


def combine_file_digests(model: Sequence[str], optimizer: Sequence[str]) -> str:
    """The state hash of a state whose model and optimizer shards have these SHA-256 digests."""
    h = hashlib.sha256(_DOMAIN)
    for digests in (model, optimizer):
        h.update(len(digests).to_bytes(4, "little"))
        for digest in digests:
            h.update(bytes.fromhex(digest))
    return h.hexdigest()


PARALLEL_HASH_BYTES = 16 << 20
"""Below this a state is hashed on the calling thread (threads would cost more than they save)."""
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _hashers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="zocheck-state-hash")
        return _pool


def state_hash(state: Mapping[str, torch.Tensor]) -> str:
    """Hex SHA-256 of the canonical state: each tensor's name, dtype, shape and raw bytes, in order.

    >>> state_hash({"w": torch.zeros(2)}) == state_hash({"w": torch.zeros(2)})
    True
    """
    parts = [shards(part) for part in split_state(state)]
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    if sum(len(p) for p in parts) > 1 and nbytes >= PARALLEL_HASH_BYTES:
        futures = [[_hashers().submit(file_sha256, shard) for shard in part] for part in parts]
        digests = [[f.result()[0] for f in part] for part in futures]
    else:
        digests = [[file_sha256(shard)[0] for shard in part] for part in parts]
    return combine_file_digests(*digests)
