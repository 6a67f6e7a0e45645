"""A step's batch in S shards, each one forward pass, added in shard order: the answer depends on S, not k.

    held = assign(shards=6, ranks=2)                    # [(0, 1, 2), (3, 4, 5)]
"""

from __future__ import annotations

from typing import Callable, Sequence

from zocheck_ray.config import JobConfig

ShardTable = list[tuple[float, float] | None]
"""Per shard: (loss sum, count), or None (not evaluated here)."""


def shard_count(job: JobConfig) -> int:
    """`task.shards`, or one per rank."""
    return job.task.shards or job.scaling.trainers


def assign(shards: int, ranks: int) -> list[tuple[int, ...]]:
    """Rank r's shards: contiguous blocks, as equal as can be (S = k: shard r)."""
    if not 1 <= ranks <= shards:
        raise ValueError(f"{ranks} ranks cannot share {shards} shards: every rank needs at least one")
    return [tuple(range(r * shards // ranks, (r + 1) * shards // ranks)) for r in range(ranks)]


def evaluate_shards(closures: Callable[[int], Callable[[], tuple[float, float]]], held: Sequence[int],
                    shards: int) -> ShardTable:
    """The table of the shards in `held`, each by its own closure."""
    table: ShardTable = [None] * shards
    for shard in held:
        table[shard] = closures(shard)()
    return table


def merge(tables: Sequence[ShardTable]) -> ShardTable:
    """Several ranks' tables as one."""
    merged: ShardTable = [None] * len(tables[0])
    for table in tables:
        for shard, pair in enumerate(table):
            if pair is not None:
                merged[shard] = pair
    return merged


def missing(table: ShardTable) -> list[int]:
    return [shard for shard, pair in enumerate(table) if pair is None]


def reduce_in_shard_order(plus: ShardTable, minus: ShardTable) -> tuple[float, float]:
    """(loss+, loss-): the pairs added in shard order in float64 (a library's order may vary)."""
    if missing(plus) or missing(minus):
        raise ValueError(f"shards {sorted(set(missing(plus)) | set(missing(minus)))} were not evaluated")
    sum_plus = count_plus = sum_minus = count_minus = 0.0
    for (s_plus, n_plus), (s_minus, n_minus) in zip(plus, minus):
        sum_plus += s_plus
        count_plus += n_plus
        sum_minus += s_minus
        count_minus += n_minus
    return sum_plus / count_plus, sum_minus / count_minus


def encode(table: ShardTable) -> tuple[float, ...]:
    """(evaluated, sum, count) per shard, for the all-gather."""
    return tuple(x for pair in table for x in ((1.0, *pair) if pair is not None else (0.0, 0.0, 0.0)))


def decode(numbers: Sequence[float]) -> ShardTable:
    return [(numbers[i + 1], numbers[i + 2]) if numbers[i] else None for i in range(0, len(numbers), 3)]
