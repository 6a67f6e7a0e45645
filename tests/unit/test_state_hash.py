"""`state_hash`: the SHA-256 over the digests of the state's canonical safetensors shards."""

from __future__ import annotations

import hashlib

import pytest
import torch

from zocheck_ray.core import hashing, state_hash


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    params = {f"model.layers.{i}.weight": torch.randn(64, 32, generator=gen) for i in range(5)}
    params["model.norm.weight"] = torch.randn(32, generator=gen).bfloat16()
    moments = {f"optimizer.exp_avg.{n}": torch.randn(t.shape, generator=gen) for n, t in params.items()}
    return {**params, **moments}


def test_the_hash_is_over_the_shards_in_order_whichever_thread_hashes_them(monkeypatch):
    state = _state()
    monkeypatch.setattr(hashing, "SHARD_BYTES", 3 * 64 * 32 * 4)  # three of the 8 KiB tensors per shard
    model, optimizer = hashing.split_state(state)
    model_shards, optimizer_shards = hashing.shards(model), hashing.shards(optimizer)
    assert [list(s) for s in model_shards] == [list(model)[:3], list(model)[3:]]
    assert len(optimizer_shards) == 2

    def file_digest(shard):
        data = hashing.safetensors_header(shard) + b"".join(bytes(hashing.raw_bytes(t)) for t in shard.values())
        return hashlib.sha256(data).hexdigest()

    expected = hashing.combine_file_digests([file_digest(s) for s in model_shards],
                                            [file_digest(s) for s in optimizer_shards])
    monkeypatch.setattr(hashing, "PARALLEL_HASH_BYTES", 1 << 40)
    assert state_hash(state) == expected  # on the calling thread
    monkeypatch.setattr(hashing, "PARALLEL_HASH_BYTES", 0)
    assert state_hash(state) == expected  # shards on the thread pool


def test_any_change_of_name_dtype_shape_bytes_or_order_changes_the_hash():
    state = _state()
    digest = state_hash(state)
    first = next(iter(state))
    renamed = {("model.renamed" if n == first else n): t for n, t in state.items()}
    reshaped = {n: (t.reshape(32, 64) if n == first else t) for n, t in state.items()}
    retyped = {n: (t.double() if n == first else t) for n, t in state.items()}
    flipped = {n: t.clone() for n, t in state.items()}
    flipped[first].view(torch.int32)[0, 0] ^= 1
    reordered = dict(reversed(list(state.items())))
    no_moments = {n: t for n, t in state.items() if not n.startswith("optimizer.")}
    variants = [renamed, reshaped, retyped, flipped, reordered, no_moments]
    assert len({digest, *(state_hash(v) for v in variants)}) == 1 + len(variants)
    assert state_hash({n: t.clone() for n, t in state.items()}) == digest


def test_a_dtype_safetensors_cannot_hold_is_named():
    with pytest.raises(TypeError, match="'model.c' has dtype torch.complex64"):
        state_hash({"model.c": torch.zeros(2, dtype=torch.complex64)})
