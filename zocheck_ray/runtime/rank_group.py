"""`RankGroup`: a trainer process's place among the data-parallel ranks: its rank, the shards it evaluates, the gloo
group that exchanges every shard's losses in shard order, and, in an elastic run, the plans that re-form the group
mid-step without a lost rank (`parallel/elastic.py`)."""

from __future__ import annotations

import logging
import queue
import time
from typing import Callable

from zocheck_ray.config import JobConfig
from zocheck_ray.runtime.hooks import TrainerHooks
from zocheck_ray.runtime.parallel.collective import GroupAbandoned, LossGroup, RankLostError, open_rendezvous
from zocheck_ray.runtime.parallel.elastic import (
    CALLS_PER_STEP, GroupPlan, PeerLost, catch_up, exchange_number, standing,
)
from zocheck_ray.runtime.parallel.shards import (
    ShardTable, assign, decode, encode, evaluate_shards, merge, missing, shard_count,
)

logger = logging.getLogger(__name__)


class RankGroup:
    """This rank's shards and group; `exchange` merges every rank's shard losses, taking over a lost peer's."""

    def __init__(self, job: JobConfig, rank: int, hooks: TrainerHooks, take_over: Callable[[], None]):
        """`take_over`: called when this process becomes rank 0 in a re-formed group (it then sends the records)."""
        self.job, self.hooks, self._take_over = job, hooks, take_over
        self.shards = shard_count(job)
        self.rank, self.ranks, self.held, self.group = rank, 0, (), None
        self.place(rank, job.scaling.trainers)
        self.elastic = job.scaling.min_trainers is not None and self.ranks > 1
        """A lost peer leaves this rank waiting for a smaller group, not torn."""
        self._plans: queue.Queue[tuple[int, GroupPlan, float]] = queue.Queue()
        """(rank, plan, when it came)."""
        self._rendezvous: dict[int, object] = {}
        self._losses: queue.Queue[PeerLost] = queue.Queue()
        self.generation = 0
        self._calls = 0
        self._last_exchange: tuple[int, ShardTable] | None = None
        self._regroups: list[tuple[int, float, float]] = []
        self._planned_at = 0.0
        self._collective_seconds: list[float] = []
        self._step_collective = 0.0

    def place(self, rank: int, ranks: int) -> None:
        """Be rank `rank` of `ranks` (a rejoin); a new group where the place changed."""
        if (rank, ranks) != (self.rank, self.ranks) or self.group is None and ranks > 1:
            self.rank, self.ranks = rank, ranks
            self.held = assign(self.shards, ranks)[rank]  # the shards this rank evaluates each step
            self.group = self._loss_group(rank, ranks)

    def _loss_group(self, rank: int, ranks: int) -> LossGroup | None:
        return LossGroup(rank, ranks, self.job.scaling.collective_timeout_seconds) if ranks > 1 else None

    def closure(self, task, model, t: int):
        """Step `t`'s closure: every shard's table, this rank's evaluated here, the others' exchanged."""
        closures: dict = {}
        self._step_collective, self._calls = 0.0, 0

        def closure_of(shard: int):
            if shard not in closures:  # the shard's rows, collated once per step
                closures[shard] = task.slice_closure(model, t, shard, self.shards)
            return closures[shard]

        def table() -> ShardTable:
            mine = evaluate_shards(closure_of, self.held, self.shards)
            return mine if self.group is None else self._exchange(t, mine, closure_of)
        return table

    def stepped(self) -> None:
        """A step ended: its exchanges' time joins the segment's."""
        if self.group is not None:
            self._collective_seconds.append(self._step_collective)

    def _exchange(self, t: int, mine: ShardTable, closure_of) -> ShardTable:
        """Every rank's table merged; a lost peer's shards are taken over at this perturbation (elastic)."""
        number = exchange_number(t, self._calls)
        self._calls += 1
        self.hooks.before_exchange(self.rank, t, number - exchange_number(t, 0))
        began = time.perf_counter()
        lost_at = None
        while True:
            try:
                gathered = self.group.gather(encode(mine), self._abandon if self.elastic else None)
                merged = merge([decode(numbers) for numbers in gathered])
                break
            except RankLostError as exc:
                if not self.elastic:
                    raise
                logger.warning("%s: waiting at step %d for the controller's smaller group", exc, t)
                if lost_at is None:  # given up: a silent peer stalled the whole wait
                    lost_at = began if isinstance(exc, GroupAbandoned) else time.perf_counter()
                    self.hooks.after_exchange_failed(self.rank, t, number - exchange_number(t, 0))
                    if not isinstance(exc, GroupAbandoned):  # else the controller knows: it planned anew
                        self._report_loss(t, number, exc)
                adopted = self._regroup(number, inside=True)
                if adopted is not None:  # a survivor completed this exchange before the loss
                    merged = adopted
                    break
                for shard in self.held:  # the lost rank's shards, at the perturbation this rank stands at
                    if mine[shard] is None:
                        mine[shard] = closure_of(shard)()
        self._step_collective += time.perf_counter() - began
        if lost_at is not None:  # (step, stall, of it the wait for the controller's plan)
            self._regroups.append((t, time.perf_counter() - lost_at, max(0.0, self._planned_at - lost_at)))
        if missing(merged):
            raise RuntimeError(f"rank {self.rank}: no rank evaluated shards {missing(merged)}")
        self._last_exchange = (number, merged)
        return merged

    # ------------------------------------------------------------------ elastic groups

    def _report_loss(self, t: int, number: int, exc: Exception) -> None:
        """Report the peers gone (`next_loss`)."""
        if self.group.key is None:
            return
        self._losses.put(PeerLost(group=self.group.key, rank=self.rank, step=t, lost=tuple(self.group.lost_peers()),
                                  exchange=number - exchange_number(t, 0), detail=str(exc).splitlines()[0]))

    def next_loss(self) -> PeerLost:
        """Waits for the next report."""
        return self._losses.get()

    def _abandon(self) -> bool:
        """Whether a newer group is planned."""
        return not self._plans.empty()

    def open_group(self, address: str, ranks: int, generation: int) -> int:
        """As rank 0 of group `generation`: open its rendezvous (the training thread may wait in an exchange)."""
        store = open_rendezvous(address, ranks, self.job.scaling.collective_timeout_seconds)
        self._rendezvous[generation] = store
        return store.port

    def offer_plan(self, rank: int, plan: GroupPlan) -> None:
        """The next group and this rank's place in it."""
        self._plans.put((rank, plan, time.perf_counter()))

    def reform(self, generation: int, step: int) -> int:
        """At a step boundary, join group `generation` unless an exchange did."""
        if self.generation < generation:
            self._regroup(exchange_number(step, 0), inside=False, generation=generation)
        return self.rank

    def _regroup(self, number: int, inside: bool, generation: int | None = None) -> ShardTable | None:
        """Join the next planned group; returns exchange `number`'s table if a survivor completed it."""
        while True:
            self.group.leave()
            rank, plan, self._planned_at = self._plans.get()
            while not self._plans.empty():  # only the newest plan stands
                rank, plan, self._planned_at = self._plans.get_nowait()
            if plan.generation <= self.generation or (generation is not None and plan.generation < generation):
                continue  # a stale plan
            if not plan.held:
                raise RankLostError(f"rank {self.rank}: no group to join ({plan.cause}); rejoining from "
                                    "the shadow")
            try:
                self._apply(rank, plan)
                gathered = self.group.gather(standing(number, inside, self._last_exchange, self.shards),
                                             self._abandon)
            except RankLostError as exc:  # lost another peer meanwhile: wait for the next plan
                logger.warning("%s: during the regroup", exc)
                if not isinstance(exc, GroupAbandoned):
                    self._report_loss(number // CALLS_PER_STEP, number, exc)
                continue
            return catch_up(gathered, number)

    def _apply(self, rank: int, plan: GroupPlan) -> None:
        self.hooks.before_regroup(self.rank, plan.generation)
        self.group = LossGroup(rank, plan.ranks, self.job.scaling.collective_timeout_seconds)  # of one too
        self.group.join(plan.address, plan.port, store=self._rendezvous.pop(plan.generation, None),
                        abandon=self._abandon)
        was_leader = self.rank == 0
        self.rank, self.ranks, self.held, self.generation = rank, plan.ranks, plan.held[rank], plan.generation
        if rank == 0 and not was_leader:
            self._take_over()  # rank 0 sends the records; the shadow gets those the lost one had not
        logger.info("rank %d of %d from group %d (%s), shards %s", rank, plan.ranks, plan.generation, plan.cause,
                    list(self.held))

    def join_group(self, address: str, port: int) -> float:
        """Join the ranks' group at rank 0's address:port; returns the seconds."""
        return self.group.join(address, port)

    def leave(self) -> None:
        if self.group is not None:
            self.group.leave()

    def times(self) -> tuple[list[float], list[tuple[int, float, float]]]:
        """(each step's exchange seconds, each mid-step regroup's (step, stall, wait for the plan)) since asked."""
        collective, self._collective_seconds = self._collective_seconds, []
        regroups, self._regroups = self._regroups, []
        return collective, regroups
