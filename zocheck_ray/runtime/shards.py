"""The shards of a step's batch: the unit data parallel shares out, so the answer depends on them, not on the ranks.

    held = assign(shards=6, ranks=2)                    # [(0, 1, 2), (3, 4, 5)]
    loss_plus, loss_minus = reduce_in_shard_order(table_plus, table_minus)

A job fixes S shards (`task.shards`; by default one per rank). Whichever rank holds a shard evaluates it in
one forward pass of its own and every rank adds the S (loss sum, count) pairs in shard order in float64, so
k ranks, and k changing mid-run, give the one-trainer S-shard run's bits.
"""

from __future__ import annotations

from typing import Callable, Sequence

from zocheck_ray.config import JobConfig

ShardTable = list[tuple[float, float] | None]
"""Per shard, in shard order: its (loss sum, count), or None where this rank did not evaluate it."""


def shard_count(job: JobConfig) -> int:
    """S: `task.shards`, or one shard per rank (the layout of plain data parallel)."""
    return job.task.shards or job.scaling.trainers


def assign(shards: int, ranks: int) -> list[tuple[int, ...]]:
    """Rank r's shards: a contiguous block, the blocks as equal as S and k allow (with S = k, shard r)."""
    if not 1 <= ranks <= shards:
        raise ValueError(f"{ranks} ranks cannot share {shards} shards: every rank needs at least one")
    return [tuple(range(r * shards // ranks, (r + 1) * shards // ranks)) for r in range(ranks)]


def evaluate_shards(closures: Callable[[int], Callable[[], tuple[float, float]]], held: Sequence[int],
                    shards: int) -> ShardTable:
    """The table of the shards in `held`, each from its own closure (one forward pass per shard)."""
    table: ShardTable = [None] * shards
    for shard in held:
        table[shard] = closures(shard)()
    return table


def merge(tables: Sequence[ShardTable]) -> ShardTable:
    """One table from several ranks' (each shard from whichever rank evaluated it)."""
    merged: ShardTable = [None] * len(tables[0])
    for table in tables:
        for shard, pair in enumerate(table):
            if pair is not None:
                merged[shard] = pair
    return merged


def missing(table: ShardTable) -> list[int]:
    return [shard for shard, pair in enumerate(table) if pair is None]


def reduce_in_shard_order(plus: ShardTable, minus: ShardTable) -> tuple[float, float]:
    """(loss+, loss-) of the global batch: the pairs added in shard order in float64 (a library reduction's
    order may vary)."""
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
    """The table as float64 numbers for the all-gather: (evaluated, sum, count) per shard."""
    return tuple(x for pair in table for x in ((1.0, *pair) if pair is not None else (0.0, 0.0, 0.0)))


def decode(numbers: Sequence[float]) -> ShardTable:
    return [(numbers[i + 1], numbers[i + 2]) if numbers[i] else None for i in range(0, len(numbers), 3)]
