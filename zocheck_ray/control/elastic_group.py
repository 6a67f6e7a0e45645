"""`ElasticGroup` (`scaling.trainers: {min, max}`): the survivors of a lost rank take its shards mid-step.

The first survivor to report a peer gone (`PeerLost`) is acted on, since Ray reports the dead rank's own
call late; the named rank is killed first, so nothing of it runs twice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import ray
from ray.exceptions import RayActorError, RayError

from zocheck_ray.actors.names import actor_states
from zocheck_ray.config import JobConfig
from zocheck_ray.control.group import DEATH_POLL_SECONDS, READINESS_WAIT_SECONDS, TrainerGroup
from zocheck_ray.control.policy import Failure
from zocheck_ray.control.summary import GroupChange
from zocheck_ray.runtime.parallel.elastic import GroupPlan, PeerLost, deal
from zocheck_ray.runtime.messages import TrainerProgress
from zocheck_ray.runtime.parallel.shards import assign, shard_count

logger = logging.getLogger(__name__)


@dataclass
class Vacancy:
    """A rank the cluster had no room for: its placement group's `ready()`, and how its process starts."""

    name: str
    ready: ray.ObjectRef
    start: Callable[[], object]


def trainer_group(job: JobConfig, ranks: list, start_standby: Callable[[str], object] | None = None,
                  names: list[str] | None = None, vacancies: list[Vacancy] = ()) -> TrainerGroup:
    """An `ElasticGroup` where `min` is set and k > 1."""
    if job.scaling.min_trainers is None or job.scaling.trainers == 1:
        return TrainerGroup(job, ranks, start_standby, names)
    return ElasticGroup(job, ranks, start_standby, names, vacancies)


class ElasticGroup(TrainerGroup):
    """The ranks of an elastic run: a lost rank's shards go to the others mid-step; a rank placed late joins."""

    def __init__(self, job: JobConfig, ranks: list, start_standby: Callable[[str], object] | None = None,
                 names: list[str] | None = None, vacancies: list[Vacancy] = ()):
        super().__init__(job, ranks, start_standby, names)
        self.min_k = job.scaling.min_trainers or self.k
        self.generation = 0
        self._reforms: list = []
        self._shrunk: list[GroupChange] = []
        self.departed: dict[str, tuple[object, str | None]] = {}
        """Ranks out of the group, (actor, incarnation) by name: lost ones, and new ones (None) to join."""
        self.vacancies = list(vacancies)
        self._newcomers: set[str] = set()
        self._probes: dict[str, object] = {}
        self._watches: dict[str, tuple[object, ray.ObjectRef | None]] = {}
        """By name (None: no trainer to ask)."""

    # ------------------------------------------------------------------ a loss

    def _gather(self, pending: dict[int, ray.ObjectRef]) -> tuple[dict[int, TrainerProgress], list[int]]:
        """As `TrainerGroup._gather`, acting on the first loss (a report, a failed call, a death)."""
        results, lost, released = {}, [], False
        poll = DEATH_POLL_SECONDS if actor_states() is not None else None
        while pending:
            watches = {} if released else self._watch()
            done, _ = ray.wait([*pending.values(), *watches], num_returns=1, timeout=poll)
            self._collect(pending, done, results, lost, poll is not None)
            for ref in set(done) & set(watches):
                gone = self._reported(watches[ref], ref, pending)
                if gone is None and not released:  # an exchange failed, nobody died (gloo's timeout)
                    self._release(list(pending), "an exchange failed with every rank alive")
                    released = True
                lost += gone or []
            if lost and not released:
                try:
                    if self.k - len(lost) >= self.min_k:
                        pending, results = self._shrink(sorted(set(lost)), pending, results)
                        lost = []
                        continue
                except RayActorError:  # the new rank 0 is gone too
                    lost = sorted(set(lost) | set(self.lost_ranks()))
                # too few: every rank stops and rejoins from the shadow
                waiting = [r for r in pending if r not in lost]
                self._release(waiting, f"ranks {lost} lost, fewer than {self.min_k} left")
                released = True
        return results, sorted(set(lost))

    def _watch(self) -> dict[ray.ObjectRef, str]:
        """Each rank's waiting `peer_lost` call, by name."""
        for name, actor in zip(self.names, self.ranks):
            if name not in self._watches or self._watches[name][0] is not actor:
                self._watches[name] = (actor, actor.peer_lost.remote())
        return {ref: name for name, (_, ref) in self._watches.items() if ref is not None and name in self.names}

    def _reported(self, name: str, ref: ray.ObjectRef, pending: dict[int, ray.ObjectRef]) -> list[int] | None:
        """The ranks a report of the current group names gone, killed and taken from `pending`; None: it
        names none."""
        actor, _ = self._watches.pop(name)
        try:
            report: PeerLost | None = ray.get(ref)
        except RayError:  # the reporter is gone too: Ray's report of its own call says so
            return []
        if report is None:
            self._watches[name] = (actor, None)  # not built: it has nothing to report
            return []
        if report.group == self.key and not report.lost:
            logger.warning("%s, and no rank is gone: every rank rejoins", report.detail)
            return None
        gone = [r for r in report.lost if r in pending] if report.group == self.key else []
        for r in gone:
            try:
                ray.kill(self.ranks[r], no_restart=False)  # Ray restarts it, to join later
            except Exception:  # gone already
                pass
            del pending[r]
        if gone:
            logger.info("rank %d reports ranks %s gone at step %d (exchange %d: %s)", report.rank, gone, report.step,
                        report.exchange, report.detail)
        return gone

    def _release(self, waiting: list[int], cause: str) -> None:
        """An empty plan to the ranks waiting for a group: they stop torn, as without `min`."""
        self.generation += 1
        plan = GroupPlan(generation=self.generation, cause=cause)
        for r in waiting:
            self.ranks[r].offer_plan.remote(r, plan)

    def _shrink(self, lost: list[int], pending: dict, results: dict) -> tuple[dict, dict]:
        """Go on without the `lost` ranks, their shards dealt round; returns `pending` and `results` by new
        rank."""
        survivors = [r for r in range(self.k) if r not in lost]
        self.generation += 1
        held = deal(self.held, lost)
        cause = f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost"
        self._reforms = self._hand_out([self.ranks[r] for r in survivors], held, cause)
        self.departed.update({self.names[r]: (self.ranks[r], self.incarnations[r]) for r in lost})
        renumbered = {r: new for new, r in enumerate(survivors)}
        self.ranks = [self.ranks[r] for r in survivors]
        self.names = [self.names[r] for r in survivors]
        self.incarnations = [self.incarnations[r] for r in survivors]
        self.times.rank_seconds = [self.times.rank_seconds[r] for r in survivors]
        self.times.rank_steps = [self.times.rank_steps[r] for r in survivors]
        self.k, self.held = len(survivors), held
        self._shrunk.append(GroupChange(kind="shrink", step=0, ranks=self.k, held=[list(h) for h in held],
                                        cause=cause, stall_seconds=0.0))
        logger.info("%s: the %d others go on, shards %s", cause, self.k, held)
        return ({renumbered[r]: ref for r, ref in pending.items() if r in renumbered},
                {renumbered[r]: p for r, p in results.items() if r in renumbered})

    def _settle(self, results: dict[int, TrainerProgress], step: int, lost: list[int]) -> list[int]:
        """Every survivor in the new group; each shrink with the slowest survivor's stall."""
        if self._reforms:
            reforms, self._reforms = self._reforms, []
            try:
                ray.get(reforms)
            except RayError as exc:
                lost = sorted(set(lost) | set(self.lost_ranks()))
                logger.warning("a regroup failed (%s): every rank rejoins", str(exc).splitlines()[0])
        for change in self._shrunk:
            stalls = [regroup for p in results.values() for regroup in p.regroups]
            slowest = max(stalls, key=lambda regroup: regroup[1], default=(step, 0.0, None))
            self.changes.append(change.model_copy(update={
                "step": min(s for s, _, _ in stalls) if stalls else step, "stall_seconds": slowest[1],
                "plan_wait_seconds": slowest[2]}))
        self._shrunk = []
        return lost

    # ------------------------------------------------------------------ a join

    def grow(self, step: int) -> GroupChange | Failure | None:
        """At a step boundary, a restarted or newly placed process restores to `step` from the shadow and joins;
        returns the change, a `Failure`, or None."""
        self._place()
        if self.k >= self.job.scaling.trainers:
            return None
        lost = [name for name in self.departed if name not in self._newcomers]
        if lost and self._standby_ready():
            return self._promote(step, lost[0])
        back = self._returned()
        return None if back is None else self._join(step, *back)

    def _promote(self, step: int, name: str) -> GroupChange | Failure | None:
        """The ready standby joins in lost rank `name`'s stead; that rank's process, once Ray restarts it,
        stands by next."""
        lost, _ = self.departed.pop(name)
        self._probes.pop(name, None)
        promoted, promoted_name = self.standby, self.standby_name
        self.standby, self.standby_name = lost, name
        self._new_standby()
        self.departed[promoted_name] = (promoted, None)
        return self._join(step, promoted_name, None, how=f"the standby {promoted_name} in {name}'s stead")

    def _join(self, step: int, name: str, incarnation: str | None, how: str | None = None
              ) -> GroupChange | Failure | None:
        """Departed `name`, whose process answers as `incarnation`, restores to `step` and joins."""
        began = time.perf_counter()
        expected = self.deliver(step)  # the shadow then holds every record before `step`
        if isinstance(expected, Failure):
            return expected
        actor, _ = self.departed[name]
        try:
            info = ray.get(actor.rejoin.remote(step, self.k, self.k + 1))
        except RayError as exc:  # still departed (ended with the run), asked again only after another restart
            self.departed[name] = (actor, incarnation)
            logger.warning("%s could not rejoin (%s); the group goes on without it", name,
                           str(exc).splitlines()[0])
            return None
        del self.departed[name]
        self.ranks.append(actor), self.names.append(name), self.incarnations.append(info.incarnation)
        self.times.rank_seconds.append(0.0), self.times.rank_steps.append(0)
        self.k += 1
        self.held = assign(shard_count(self.job), self.k)
        self.generation += 1
        how = f"{how}: rank {self.k - 1}" if how else \
            f"scale-up: resources for rank {self.k - 1} appeared ({name})" if name in self._newcomers else \
            f"{name} back after Ray restarted its process: rank {self.k - 1}"
        self._newcomers.discard(name)
        cause = f"{how}, from the shadow's {info.source} image of step {info.image_step} and " \
                f"{info.replayed_records} records"
        try:
            ray.get(self._hand_out(self.ranks, self.held, cause))
        except RayActorError as exc:
            return Failure("trainer_lost", step, f"lost while a rank joined: {str(exc).splitlines()[0]}",
                           ranks=self.lost_ranks())
        self._note_restarts()
        change = GroupChange(kind="join", step=step, ranks=self.k, held=[list(h) for h in self.held], cause=cause,
                             stall_seconds=time.perf_counter() - began)
        self.changes.append(change)
        logger.info("%s; %d ranks, shards %s", cause, self.k, self.held)
        return change

    def _place(self) -> None:
        """Start a process in each vacancy the cluster has placed: it builds while the others train."""
        placed = set(ray.wait([v.ready for v in self.vacancies], num_returns=len(self.vacancies), timeout=0)[0]) \
            if self.vacancies else set()
        for vacancy in [v for v in self.vacancies if v.ready in placed]:
            self.vacancies.remove(vacancy)
            self.departed[vacancy.name] = (vacancy.start(), None)
            self._newcomers.add(vacancy.name)
            logger.info("the cluster has room for %s: its process starts, to join at a step boundary", vacancy.name)

    def _first_group(self) -> None:
        """Fewer ranks than `max` (the cluster's room): their group forms by a plan, as after a join."""
        if self.k == self.job.scaling.trainers:
            return super()._first_group()
        self.generation += 1
        ray.get(self._hand_out(self.ranks, self.held, f"{self.k} of {self.job.scaling.trainers} ranks placed"))

    def _hand_out(self, ranks: list, held: list[tuple[int, ...]], cause: str) -> list:
        """Open group `generation` at `ranks[0]`, give each rank its place; returns the `reform` calls."""
        address, port = ray.get(ranks[0].open_group.remote(self.job.scaling.placement == "pack", len(ranks),
                                                           self.generation))
        self.key = (address, port)
        plan = GroupPlan(generation=self.generation, held=tuple(held), address=address, port=port, cause=cause)
        for r, rank in enumerate(ranks):
            rank.offer_plan.remote(r, plan)
        return [rank.reform.remote(self.generation) for rank in ranks]

    def _returned(self) -> tuple[str, str] | None:
        """(name, incarnation) of a departed rank whose new process answers, or None."""
        for name, (actor, incarnation) in list(self.departed.items()):
            if name not in self._probes:
                self._probes[name] = actor.recovery.remote()  # waits while Ray restarts the process
            probe = self._probes[name]
            if not ray.wait([probe], timeout=READINESS_WAIT_SECONDS)[0]:
                continue
            del self._probes[name]
            try:
                info = ray.get(probe)
            except RayError:  # gone for good
                del self.departed[name]
                continue
            if info.incarnation != incarnation:
                return name, info.incarnation
        return None

    def kill(self) -> list:
        """As `TrainerGroup.kill`, the departed too."""
        departed = [actor for actor, _ in self.departed.values()]
        for actor in departed:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # gone already
                pass
        return [*super().kill(), *departed]
