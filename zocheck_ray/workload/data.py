"""Deterministic training data: the batch of step t is a pure function of (data_seed, t)."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch

CORPUS = [
    "the movie was wonderful and the acting was great",
    "a dull film with a terrible plot",
    "i loved every minute of this delightful story",
    "the worst movie i have seen in years",
    "a charming and beautiful film",
    "boring characters and a predictable ending",
    "an uplifting tale told with warmth and wit",
    "the dialogue was clumsy and the pacing slow",
]
"""A small built-in corpus (benchmarks that time the trainer apart from any task use it)."""


def encode(text: str, vocab_size: int) -> list[int]:
    """Byte-level ids folded into the model's vocabulary (id 0 pads, 1 starts)."""
    return [1] + [2 + b % (vocab_size - 2) for b in text.encode()]


def corpus_tensor(seq_len: int, vocab_size: int) -> torch.Tensor:
    import torch  # here: the tokenizers (and so the job's schema) use this module without torch

    rows = [encode(s, vocab_size)[:seq_len] for s in CORPUS]
    return torch.tensor([r + [0] * (seq_len - len(r)) for r in rows])


def batch_indices(data_seed: int, step: int, batch_size: int, n_rows: int) -> list[int]:
    """Row indices of step `step`'s batch: SHA-256 of (data_seed, step), no global RNG state."""
    out = []
    for i in range(batch_size):
        digest = hashlib.sha256(f"{data_seed}:{step}:{i}".encode()).digest()
        out.append(int.from_bytes(digest[:8], "little") % n_rows)
    return out


def step_seed(run_seed: int, step: int) -> int:
    """The perturbation seed of step `step` (unsigned 64-bit), a pure function of (run_seed, step)."""
    return int.from_bytes(hashlib.sha256(f"zo-seed:{run_seed}:{step}".encode()).digest()[:8], "little")


def canonical_json(record: dict) -> str:
    """A record's canonical encoding: sorted keys, no whitespace, text as written (JSON's escapes only)."""
    return json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def rows_fingerprint(records: Iterable[dict]) -> str:
    """SHA-256 (hex) of the records' canonical encodings in order, one a line (JSON escapes newlines), so the
    same rows from any source give the same fingerprint."""
    digest = hashlib.sha256()
    for record in records:
        digest.update(canonical_json(record).encode() + b"\n")
    return digest.hexdigest()
