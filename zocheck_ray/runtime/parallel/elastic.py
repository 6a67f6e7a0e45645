"""Elastic data parallel: a lost rank's survivors form a smaller group mid-step and take its shards.

Survivors wait in an exchange, at most one apart. The new group swaps where each stands (`standing`): a
laggard adopts the table one ahead completed (`catch_up`), the others evaluate their new shards at the
perturbation they stand at and repeat the exchange. No rank perturbs twice.
"""

from __future__ import annotations

from typing import Sequence

from pydantic import BaseModel, ConfigDict

from zocheck_ray.runtime.parallel.shards import ShardTable, decode, encode

CALLS_PER_STEP = 1024
"""Exchange number = step * CALLS_PER_STEP + place in the step."""


class GroupPlan(BaseModel):
    """A new group: each rank's shards and rank 0's rendezvous."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    generation: int
    held: tuple[tuple[int, ...], ...] = ()
    """Empty: no group (too few survivors)."""
    address: str = ""
    port: int = 0
    cause: str = ""

    @property
    def ranks(self) -> int:
        return len(self.held)


class PeerLost(BaseModel):
    """A survivor's failed exchange (0: at +eps) and the peers it found gone, for the controller."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group: tuple[str, int]
    rank: int
    step: int
    exchange: int
    lost: tuple[int, ...]
    detail: str = ""


def exchange_number(step: int, call: int) -> int:
    return step * CALLS_PER_STEP + call


def deal(held: Sequence[Sequence[int]], lost: Sequence[int]) -> list[tuple[int, ...]]:
    """The survivors' shards: their own, and the lost ones' dealt round."""
    survivors = [r for r in range(len(held)) if r not in lost]
    if not survivors:
        raise ValueError("no rank survives to take the shards")
    new = [list(held[r]) for r in survivors]
    orphans = sorted(shard for r in lost for shard in held[r])
    for i, shard in enumerate(orphans):
        new[i % len(new)].append(shard)
    return [tuple(sorted(shards)) for shards in new]


def standing(number: int, inside: bool, last: tuple[int, ShardTable] | None, shards: int) -> tuple[float, ...]:
    """(exchange it is at, whether inside it, last completed exchange, its table)."""
    last_number, table = last if last is not None else (-1, [None] * shards)
    return (float(number), float(inside), float(last_number), *encode(table))


def catch_up(gathered: Sequence[Sequence[float]], number: int) -> ShardTable | None:
    """Exchange `number`'s table from a survivor one ahead; None where none is ahead."""
    ahead = max(int(g[0]) for g in gathered)
    if number >= ahead:
        return None
    for g in gathered:
        if int(g[0]) == ahead and int(g[2]) == number:
            return decode(g[3:])
    raise RuntimeError(f"exchange {number}: the survivors stand {ahead - number} exchanges apart and none holds "
                       "its table")
