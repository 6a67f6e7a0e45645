"""Sampling rows as pure functions of the rows and a seed: held-out rows, our k-shot and MeZO's sampler.

    kept = k_shot(rows, 16, data_seed, label_of=lambda row: row.label)
    train, dev, held_out = mezo_sample(train_rows, held_rows, 1000, 500, 1000, seed=0)

k-shot keeps, per class, the k rows of smallest SHA-256 of (seed, row), in file order.
"""

from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path
from typing import Callable, Hashable, Sequence, TypeVar

import numpy as np

from zocheck_ray.workload.datafiles import Splits
from zocheck_ray.workload.errors import WorkloadError
from zocheck_ray.workload.task_config import MEZO_KINDS

Row = TypeVar("Row")


def row_rank(seed: int, record: object) -> bytes:
    """The SHA-256 of (seed, JSON-able record) that orders rows."""
    return hashlib.sha256(f"{seed}:".encode() + json.dumps(record, sort_keys=True, default=str).encode()).digest()


def k_shot(rows: Sequence[Row], k: int | None, seed: int, label_of: Callable[[Row], Hashable],
           content_of: Callable[[Row], object] = lambda row: row) -> list[Row]:
    """Per class of `label_of(row)`, the k rows of smallest `row_rank(seed, content_of(row))`, in order."""
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
    """(train, dev, held-out) by MeZO's sampler or our k-shot (held-out: the first `eval_size`)."""
    if config.num_train is not None:
        return mezo_sample(train, held, config.num_train, config.num_dev, config.num_eval, config.train_set_seed)
    return k_shot(train, config.k_shot, config.data_seed, label_of, content_of), [], list(held[:config.eval_size])


def hold_out(rows: Sequence[Row], eval_size: int, rank: Callable[[Row], bytes]) -> tuple[list[Row], list[Row]]:
    """(train, held-out): the `eval_size` rows of smallest `rank(row)` held out, file order kept."""
    if eval_size >= len(rows):
        raise WorkloadError(f"task.eval_size={eval_size} holds out every row of {Path(rows[0].path)} ({len(rows)} "
                            "rows); lower eval_size or give held-out rows in task.eval_path")
    ranked = sorted(range(len(rows)), key=lambda i: (rank(rows[i]), i))
    held = set(ranked[:eval_size])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def split_rows(rows: Sequence[Row], eval_size: int) -> tuple[list[Row], list[Row]]:
    """`hold_out` by the SHA-256 of the text."""
    return hold_out(rows, eval_size, lambda row: hashlib.sha256(row.text.encode()).digest())


def sample(config, splits: Splits) -> Splits:
    """`sample_rows` of `TaskRow`s, held-out rows first held out where no file holds them."""
    return sample_with_shortfalls(config, splits)[0]


def sample_with_shortfalls(config, splits: Splits) -> tuple[Splits, list[str]]:
    """`sample`, and what a sampler was asked for beyond the rows there are, in words with the numbers (its
    rows are all taken: a warning of the run's, not an error)."""
    train, held = splits.train, splits.held
    if held is None:
        if config.num_train is not None:
            raise WorkloadError("MeZO's sampler (task.num_train) draws held-out rows from a validation split: give "
                                "task.eval_path, or a save_to_disk folder with task.eval_split (kind sft: or "
                                "eval_rows)")
        if config.kind in MEZO_KINDS or config.kind == "sft":
            train, held = hold_out(train, config.eval_size, lambda row: row_rank(config.data_seed, row.content))
        else:
            train, held = hold_out(train, config.eval_size,
                                   lambda row: hashlib.sha256(row.fields["text"].encode()).digest())
    shortfalls = _shortfalls(config, train, held, splits.held is not None)
    train, dev, held = sample_rows(config, train, held, lambda row: row.label, lambda row: row.content)
    return Splits(train, held, dev), shortfalls


def _shortfalls(config, train: Sequence, held: Sequence, held_from_file: bool) -> list[str]:
    """What `sample_rows` will be short of, given the training and held-out rows it draws from."""
    out = []
    where = _source(train, config.data_path)
    if config.num_train is not None:
        asked = config.num_train + (config.num_dev or 0)
        if asked > len(train):
            dev = min(config.num_dev or 0, len(train))
            out.append(f"task.num_train={config.num_train}" + (f" and task.num_dev={config.num_dev}" if config.num_dev
                                                                 else "") +
                       f" draw {asked} rows, but {where} has {len(train)} training rows: {len(train) - dev} train"
                       + (f" and {dev} dev" if config.num_dev else ""))
        if config.num_eval is not None and config.num_eval > len(held):
            out.append(f"task.num_eval={config.num_eval} draws {config.num_eval} held-out rows, but "
                       f"{_source(held, config.eval_path)} has {len(held)}: all {len(held)} evaluated")
        return out
    if config.k_shot is not None:
        counts = collections.Counter(row.label for row in train)
        short = {label: n for label, n in sorted(counts.items()) if n < config.k_shot}
        if short:
            kept = sum(min(n, config.k_shot) for n in counts.values())
            names = config.labels
            out.append(f"task.k_shot={config.k_shot} asks for {config.k_shot} training rows per label, but {where} "
                       "has " + ", ".join(f"{n} of label {names[label] if 0 <= label < len(names) else label}"
                                          for label, n in short.items())
                       + f": {kept} training rows, not {config.k_shot * len(counts)}")
    if held_from_file and "eval_size" in config.model_fields_set and config.eval_size > len(held):
        out.append(f"task.eval_size={config.eval_size} asks for {config.eval_size} held-out rows, but "
                   f"{_source(held, config.eval_path)} has {len(held)}: all {len(held)} evaluated")
    return out


def _source(rows: Sequence, fallback) -> str:
    """The file (or rows handed over) that `rows` came from."""
    return str(rows[0].path) if rows else str(fallback)


__all__ = ["hold_out", "k_shot", "mezo_sample", "mezo_subset", "row_rank", "sample", "sample_rows",
           "sample_with_shortfalls", "split_rows"]
