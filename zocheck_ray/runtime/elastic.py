"""Elastic data parallel: the survivors of a lost rank form a smaller group mid-step and take its shards.

    plan = GroupPlan(generation=1, held=((0, 1, 2), (3, 4, 5)), address="127.0.0.1", port=29513, cause="...")

A rank lost mid-step leaves the survivors at the perturbation they stand at, each waiting in an exchange
(or, where the exchange in flight reached some of them, one exchange on). In the new group they first swap
where they stand (`standing`), so a laggard adopts the table a survivor completed (`catch_up`); the others
evaluate the shards they took over at their own perturbation and repeat the exchange. No rank perturbs twice,
so the step's bits are those of the one-trainer S-shard run.
"""

from __future__ import annotations

from typing import Sequence

from pydantic import BaseModel, ConfigDict

from zocheck_ray.runtime.shards import ShardTable, decode, encode

CALLS_PER_STEP = 1024
"""An exchange's number is step * CALLS_PER_STEP + its place in the step (a step makes a few)."""


class GroupPlan(BaseModel):
    """The controller's new group: its ranks' shards (by new rank) and rank 0's rendezvous."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    generation: int
    """Counts the groups the controller formed (a plan of an older one is stale)."""
    held: tuple[tuple[int, ...], ...] = ()
    """Each new rank's shards; empty: no group (too few survivors), the ranks stop and rejoin from the shadow."""
    address: str = ""
    port: int = 0
    cause: str = ""

    @property
    def ranks(self) -> int:
        return len(self.held)


def exchange_number(step: int, call: int) -> int:
    return step * CALLS_PER_STEP + call


def deal(held: Sequence[Sequence[int]], lost: Sequence[int]) -> list[tuple[int, ...]]:
    """The survivors' shards: each keeps its own and the lost ranks' shards go round in survivor order."""
    survivors = [r for r in range(len(held)) if r not in lost]
    if not survivors:
        raise ValueError("no rank survives to take the shards")
    new = [list(held[r]) for r in survivors]
    orphans = sorted(shard for r in lost for shard in held[r])
    for i, shard in enumerate(orphans):
        new[i % len(new)].append(shard)
    return [tuple(sorted(shards)) for shards in new]


def standing(number: int, inside: bool, last: tuple[int, ShardTable] | None, shards: int) -> tuple[float, ...]:
    """Where a rank stands, for the new group's first exchange: the exchange it waits in (or would make next),
    whether it waits inside one, and the last exchange it completed with that exchange's whole table."""
    last_number, table = last if last is not None else (-1, [None] * shards)
    return (float(number), float(inside), float(last_number), *encode(table))


def catch_up(gathered: Sequence[Sequence[float]], number: int) -> ShardTable | None:
    """A laggard's table of exchange `number`, completed by a survivor one exchange on; None where no survivor
    is ahead (the rank evaluates its new shards and repeats the exchange)."""
    ahead = max(int(g[0]) for g in gathered)
    if number >= ahead:
        return None
    for g in gathered:
        if int(g[0]) == ahead and int(g[2]) == number:
            return decode(g[3:])
    raise RuntimeError(f"exchange {number}: the survivors stand {ahead - number} exchanges apart and none holds "
                       "its table")
