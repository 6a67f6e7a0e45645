"""MeZO's k-shot sampling, as a pure function of the rows and a seed.

    kept = k_shot(rows, 16, data_seed, label_of=lambda row: row.label)

Per class, the k rows whose SHA-256 of (seed, row) is smallest, in file order: independent of the
file's order and of other classes' rows, so a recovered trainer draws the same sample.
"""

from __future__ import annotations

import collections
import hashlib
import json
from typing import Callable, Hashable, Sequence, TypeVar

Row = TypeVar("Row")


def row_rank(seed: int, record: object) -> bytes:
    """The SHA-256 of (seed, record) that orders rows for sampling and holding out (record: JSON-able)."""
    return hashlib.sha256(f"{seed}:".encode() + json.dumps(record, sort_keys=True, default=str).encode()).digest()


def k_shot(rows: Sequence[Row], k: int | None, seed: int, label_of: Callable[[Row], Hashable],
           content_of: Callable[[Row], object] = lambda row: row) -> list[Row]:
    """Per class of `label_of(row)`, the k rows of smallest `row_rank(seed, content_of(row))`, in order; every row if
    k is None."""
    if k is None:
        return list(rows)
    by_class: dict = collections.defaultdict(list)
    for i, row in enumerate(rows):
        by_class[label_of(row)].append(i)
    keep: set[int] = set()
    for members in by_class.values():
        keep.update(sorted(members, key=lambda i: (row_rank(seed, content_of(rows[i])), i))[:k])
    return [row for i, row in enumerate(rows) if i in keep]


__all__ = ["k_shot", "row_rank"]
