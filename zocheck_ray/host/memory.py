"""A state as one host buffer: tensors at 64-byte-aligned offsets of one anonymous mapping. The replica, the images and a trainer's skeleton share this layout, so an image is written into a
skeleton in long runs.
"""

from __future__ import annotations

import mmap
import warnings
from typing import Iterable

import torch

ALIGN = 64
"""Every tensor starts on a 64-byte boundary, so views of any dtype are aligned."""


def aligned_offsets(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Where tensors of `sizes` bytes start, in order, each on an `ALIGN` boundary; and the buffer's bytes."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += (size + ALIGN - 1) // ALIGN * ALIGN
    return offsets, total


def anonymous_mapping(nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    """A private anonymous mapping of `nbytes` (> 0) as a uint8 tensor, nothing faulted yet, and the mapping, which
    its views keep alive."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return frombuffer(region), region


def frombuffer(region: mmap.mmap) -> torch.Tensor:
    """A buffer's bytes (a mapping, a read-only array) as a uint8 tensor (no copy)."""
    with warnings.catch_warnings():  # a read-only mapping is fine for reading; torch warns regardless
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(region, dtype=torch.uint8)


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """A process's `VmHWM`, `VmRSS`, `RssAnon` and `RssShmem` from /proc/PID/status, in bytes ({} where there is
    none)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssShmem"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out
