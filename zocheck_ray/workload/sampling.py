"""Sampling rows as pure functions of the rows and a seed: our k-shot and MeZO's sampler.

    kept = k_shot(rows, 16, data_seed, label_of=lambda row: row.label)
    train, dev, held_out = mezo_sample(train_rows, held_rows, 1000, 500, 1000, seed=0)

k-shot keeps, per class, the k rows of smallest SHA-256 of (seed, row), in file order.
"""

from __future__ import annotations

import collections
import hashlib
import json
from typing import Callable, Hashable, Sequence, TypeVar

import numpy as np

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


def mezo_subset(rows: Sequence[Row], seed: int, num: int) -> list[Row]:
    """MeZO's `sample_subset`: a seeded numpy permutation's first `num` rows."""
    return [rows[i] for i in np.random.RandomState(seed).permutation(len(rows))[:num]]


def mezo_sample(train: Sequence[Row], held: Sequence[Row], num_train: int, num_dev: int | None, num_eval: int | None,
                seed: int) -> tuple[list[Row], list[Row], list[Row]]:
    """(train, dev, held-out) as MeZO's run.py draws them: the dev rows end the training draw."""
    picked = mezo_subset(train, seed, num_train + (num_dev or 0))
    split = len(picked) - (num_dev or 0)
    return picked[:split], picked[split:], list(held) if num_eval is None else mezo_subset(held, seed, num_eval)


def sample_rows(config, train: Sequence[Row], held: Sequence[Row], label_of: Callable[[Row], Hashable],
                content_of: Callable[[Row], object] = lambda row: row) -> tuple[list[Row], list[Row], list[Row]]:
    """(train, dev, held-out) rows of a `TaskConfig`."""
    if config.num_train is not None:
        return mezo_sample(train, held, config.num_train, config.num_dev, config.num_eval, config.train_set_seed)
    return k_shot(train, config.k_shot, config.data_seed, label_of, content_of), [], list(held[:config.eval_size])


__all__ = ["k_shot", "mezo_sample", "mezo_subset", "row_rank", "sample_rows"]
