"""A state image: one flat byte buffer plus a JSON-able layout, for the Ray object store.

One contiguous buffer makes the snapshot one copy and lets `ray.get` return it
zero-copy from shared memory; the layout says where each tensor lives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zocheck_ray.core.layout import DTYPE_BY_NAME, DTYPES


ALIGN = 64
"""Every tensor starts on a 64-byte boundary, so views of any dtype are aligned."""


@dataclass(frozen=True)
class ImageLayout:
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> "ImageLayout":
        offsets, total = [], 0
        for t in state.values():
            offsets.append(total)
            total += (t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN
        return cls(tuple(state), tuple(DTYPES[t.dtype] for t in state.values()),
                   tuple(tuple(t.shape) for t in state.values()), tuple(offsets), total)


def new_buffer(layout: ImageLayout) -> np.ndarray:
    return np.empty(layout.nbytes, dtype=np.uint8)


def pack_into(buffer: np.ndarray, state: dict[str, torch.Tensor], layout: ImageLayout) -> np.ndarray:
    """Copy `state` (any device) into `buffer`; one copy per tensor."""
    flat = torch.from_numpy(buffer)
    for name, offset in zip(layout.names, layout.offsets):
        t = state[name].detach()
        size = t.numel() * t.element_size()
        flat[offset : offset + size].copy_(t.reshape(-1).view(torch.uint8), non_blocking=False)
    return buffer


def pack(state: dict[str, torch.Tensor]) -> tuple[np.ndarray, ImageLayout]:
    layout = ImageLayout.of(state)
    return pack_into(new_buffer(layout), state, layout), layout


def unpack(buffer: np.ndarray, layout: ImageLayout, copy: bool = True) -> dict[str, torch.Tensor]:
    """Tensors over (copy=False) or copied out of (copy=True) the buffer."""
    if copy or not buffer.flags.writeable:
        buffer = buffer.copy()
    flat = torch.from_numpy(buffer)
    out = {}
    for name, dtype, shape, offset in zip(layout.names, layout.dtypes, layout.shapes, layout.offsets):
        torch_dtype = DTYPE_BY_NAME[dtype]
        numel = int(np.prod(shape)) if shape else 1
        size = numel * torch.empty((), dtype=torch_dtype).element_size()
        out[name] = flat[offset : offset + size].view(torch_dtype).reshape(shape)
    return out
