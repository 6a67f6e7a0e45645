"""`state_hash`: SHA-256 of a canonical state, the identity recovery is judged by."""

from __future__ import annotations

import hashlib
import json
import sys

import torch

_DOMAIN = b"zocheck-ray state v1\0"


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def state_hash(state: dict[str, torch.Tensor]) -> str:
    """Hex SHA-256 over each tensor's name, dtype, shape and raw little-endian bytes, in order.

    >>> state_hash({"w": torch.zeros(2)}) == state_hash({"w": torch.zeros(2)})
    True
    """
    if sys.byteorder != "little":  # raw bytes are hashed as stored
        raise RuntimeError("state_hash assumes a little-endian host")
    h = hashlib.sha256(_DOMAIN)
    for name, tensor in state.items():
        header = json.dumps([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]).encode()
        h.update(len(header).to_bytes(4, "little"))
        h.update(header)
        h.update(_raw_bytes(tensor))
    return h.hexdigest()
