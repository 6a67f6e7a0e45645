"""Streaming safetensors files: written straight from tensor memory, read straight into tensors.

The format (https://huggingface.co/docs/safetensors): a little-endian u64 header length, a JSON
header of dtypes, shapes and offsets, then the raw bytes. Written here rather than by
`safetensors.torch.save_file` so that a save streams and hashes tensor memory with no serialized
copy of the state. Nothing here unpickles anything.
"""

from __future__ import annotations

import hashlib
import json
import struct
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import BinaryIO, Mapping

import torch

from zocheck_ray.core.dtypes import SAFETENSORS
from zocheck_ray.core.hashing import file_sha256, raw_bytes, safetensors_header
from zocheck_ray.storage.errors import CorruptSnapshotError

CHUNK_BYTES = 16 << 20
"""Bytes written or read (and hashed) at a time: full speed, yet small enough to pipeline."""
MAX_HEADER_BYTES = 100 << 20



@dataclass(frozen=True)
class FileDigest:
    sha256: str
    size: int


def write_tensors(f: BinaryIO, tensors: Mapping[str, torch.Tensor], pool: ThreadPoolExecutor) -> Future:
    """Stream the safetensors file of `tensors` to `f`; returns the future `FileDigest` that `pool` computes
    meanwhile. The tensors must not change until it is done."""
    header = safetensors_header(tensors)
    digest = pool.submit(lambda: FileDigest(*file_sha256(tensors, header)))  # hashlib releases the GIL
    try:
        f.write(header)
        for t in tensors.values():
            data = raw_bytes(t)
            for a in range(0, len(data), CHUNK_BYTES):
                f.write(data[a : a + CHUNK_BYTES])
    except BaseException:
        wait([digest])  # the tensors are not read once this raises
        raise
    return digest


def _read_exact(f: BinaryIO, n: int, url: str, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CorruptSnapshotError(f"{url} is truncated: {what} needs {n} bytes, {len(data)} present", url)
    return data


def _fill(f: BinaryIO, target: memoryview, url: str) -> None:
    got = 0
    while got < len(target):
        n = f.readinto(target[got:])
        if not n:
            raise CorruptSnapshotError(f"{url} is truncated inside its data section", url)
        got += n


def read_tensors(f: BinaryIO, url: str, out: Mapping[str, torch.Tensor], size: int,
                 pool: ThreadPoolExecutor) -> FileDigest:
    """Fill the preallocated CPU tensors `out` from the safetensors stream `f`; returns its digest."""
    h = hashlib.sha256()
    prefix = _read_exact(f, 8, url, "the header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > min(MAX_HEADER_BYTES, max(size - 8, 0)):
        raise CorruptSnapshotError(f"{url} has an impossible header length {n} (file size {size})", url)
    raw_header = _read_exact(f, n, url, "the header")
    h.update(prefix)
    h.update(raw_header)
    try:
        header = json.loads(raw_header)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        header.pop("__metadata__", None)
        entries = sorted(((v["data_offsets"][0], v["data_offsets"][1], k, v) for k, v in header.items()))
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise CorruptSnapshotError(f"{url} has an unreadable safetensors header: {exc}", url) from exc
    if set(header) != set(out):
        missing, extra = sorted(set(out) - set(header)), sorted(set(header) - set(out))
        raise CorruptSnapshotError(f"{url} holds other tensors than its manifest lists "
                                   f"(missing {missing[:3]}, unexpected {extra[:3]})", url)
    position = 0
    for begin, end, name, entry in entries:
        t = out[name]
        if (entry.get("dtype") != SAFETENSORS[t.dtype] or entry.get("shape") != list(t.shape)
                or begin != position or end - begin != t.numel() * t.element_size()):
            raise CorruptSnapshotError(f"{url}: tensor {name!r} is stored as {entry} but the manifest says "
                                       f"{SAFETENSORS[t.dtype]} {list(t.shape)} at offset {position}", url)
        position = end
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        pending = None
        try:
            for a in range(0, len(data), CHUNK_BYTES):
                chunk = data[a : a + CHUNK_BYTES]
                _fill(f, chunk, url)
                if pending is not None:
                    pending.result()
                pending = pool.submit(h.update, chunk)
        finally:  # the tensor is not read once this returns or raises
            if pending is not None:
                pending.result()
    if f.read(1):
        raise CorruptSnapshotError(f"{url} has bytes after its last tensor", url)
    return FileDigest(h.hexdigest(), 8 + n + position)
