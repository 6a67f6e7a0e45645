"""`TrainerGroup`: a run's trainer processes, driven and recovered together.

A single trainer is a group of one; data parallel is a group of k ranks whose gloo process
group the group forms. The group owns its actors and knows three things:

- `run(target)`: every rank trains to `target`; a rank that dies (seen in Ray's state API at
  once, not after Ray's wait for the death's details; where the cluster has no state API, when
  its call fails), or a gather that breaks, comes back as a `Failure` (the step boundary every
  rank had reached);
- `recover(failure)`: the survivors hand the shadow the records it lacks; each lost rank is
  replaced, by the warm standby when there is one (promoted at once: the failed call already
  said the process is gone, nothing waits on Ray's death timer) or else by Ray's restart of
  its process; every rank then rejoins at the shadow's step (image plus records) and the
  process group is formed again. A lost process that Ray restarts becomes the next standby;
- `form()`: the ranks' process group (k > 1).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from zocheck_ray.runtime.messages import KernelInfo, RecoveryInfo, TrainerProgress, TrainerTimes
from zocheck_ray.actors.names import actor_states, actor_status, trainer_name
from zocheck_ray.actors.link import call_when_alive, died_since, wait_until_restarted
from zocheck_ray.runtime.shadow import ShadowRestartedError
from zocheck_ray.runtime.trainer import RejoinRequiredError
from zocheck_ray.config import JobConfig
from zocheck_ray.control.outcomes import Restored, StepTimes
from zocheck_ray.control.policy import Failure

logger = logging.getLogger(__name__)


DEATH_POLL_SECONDS = 0.1
"""How often a segment's wait asks Ray's state API whether a rank's process died (one query per rank)."""
READINESS_WAIT_SECONDS = 0.05
"""How long `prepare_standby` waits for the standby's report (an idle process answers at once; one that is
starting answers at a later call)."""
PROBE_SECONDS = 5.0
"""How long `lost_ranks` waits for the ranks' answers where there is no state API (a busy rank is alive)."""


class TrainerGroup:
    """The trainer ranks of a run and its optional warm standby (see the module docstring)."""

    def __init__(self, job: JobConfig, ranks: list, start_standby: Callable[[str], object] | None = None):
        self.job = job
        self.k = job.trainers
        self.ranks = list(ranks)
        """The actor serving each rank (a promoted standby takes a lost rank's place)."""
        self.names = [trainer_name(job.run_id, r) for r in range(self.k)]
        """The name of the actor serving each rank (Ray's state API finds an actor by name)."""
        self.standby_name = trainer_name(job.run_id, "standby")
        self.incarnations: list[str | None] = [None] * self.k
        self._start_standby = start_standby
        self._standbys_started = 0
        """Each standby has a name of its own: one ended before it was ready may not be gone yet."""
        self.standby = None
        """The waiting process a lost rank is replaced by (None: no standby, or not started yet)."""
        self._preparing = None
        """The standby's `prepare` call in flight."""
        self._asking = None
        """The standby's `readiness` call in flight (its process's own report: whether it has built)."""
        self._standby_built = False
        """Whether the standby's process said it has built its model, with no call to it lost since."""
        self._prepare_failed = False
        """The standby's `prepare` raised: it is not asked again."""
        self._following = None
        """The standby's `follow` call in flight (it copies each new image of the shadow's in while it waits)."""
        self.durable_next: int | None = None
        """Every record before this step is durable (the holding ranks drop them)."""
        self._restarts: dict[str, int] = {}
        """Each actor's restarts, by name, as Ray's state API last reported them: a lost one is back once they
        grow."""
        self.times = StepTimes([0.0] * self.k, [0] * self.k)

    @property
    def leader(self):
        """Rank 0: it publishes the records, evaluates, and writes a resync's state."""
        return self.ranks[0]

    def all_actors(self) -> list:
        return [*self.ranks, *([self.standby] if self.standby is not None else [])]

    def all_names(self) -> list[str]:
        """The names of `all_actors`, in the same order."""
        return [*self.names, *([self.standby_name] if self.standby is not None else [])]

    # ------------------------------------------------------------------ starting

    def start(self) -> RecoveryInfo:
        """Every rank's first state (fresh, or the shadow's image of a resumed run); returns rank 0's."""
        infos = [call_when_alive(lambda rank=rank: rank.recovery.remote()) for rank in self.ranks]
        if any(info.step != infos[0].step for info in infos[1:]):  # a rank asked before rank 0 initialized
            infos[1:] = ray.get([rank.rejoin.remote(infos[0].step) for rank in self.ranks[1:]])
        self.incarnations = [info.incarnation for info in infos]
        if self.k > 1:
            self.form()
        self._note_restarts()
        return infos[0]

    def _note_restarts(self) -> None:
        self._restarts = {name: status.restarts for name in self.all_names()
                          if (status := actor_status(name)) is not None}

    def start_standby(self) -> None:
        """Start the warm standby (once the run is steady); it builds its skeleton while training goes on.
        Called after every segment: a standby process Ray restarted is asked to build (`prepare_standby`), a
        built one to follow the shadow's images (`_follow`)."""
        if self._start_standby is None:
            return
        if self.standby is None:
            self._standbys_started += 1
            n = self._standbys_started
            self.standby_name = trainer_name(self.job.run_id, "standby" if n == 1 else f"standby{n}")
            self.standby = self._start_standby(self.standby_name)
            return
        if self.prepare_standby():
            self._follow()

    def standby_state(self) -> str:
        """`none` (no standby, or not started yet), `starting` (building its model) or `ready` (a lost rank is
        replaced by it at once): what `status` reports."""
        if self.standby is None:
            return "none"
        return "ready" if self._standby_built else "starting"

    def trainer_times(self) -> TrainerTimes | None:
        """The ranks' step times over the last segment, and the standby's state, for the shadow's metrics."""
        recent = self.times.recent
        return recent.model_copy(update={"standby": self.standby_state()}) if recent is not None else None

    def _drop_unready_standby(self) -> None:
        """End a standby that is still building when a rank is lost: its set-up would take the cores from Ray's
        restart of the lost process, so a loss before the standby is ready costs what it costs without one. A
        new standby starts once the run is steady again."""
        try:
            ray.kill(self.standby, no_restart=True)
        except Exception:  # gone already
            pass
        logger.info("the standby was not ready when a rank was lost: ended, to leave the cores to the restart")
        self.standby = None
        self._following = self._preparing = self._asking = None
        self._standby_built = self._prepare_failed = False

    def prepare_standby(self) -> bool:
        """Ask the standby's process to build its model where it waits to (a process Ray restarted: the one lost
        before a promotion, or a standby that died; see `trainer_actor.py`); True once the process that
        answers has built it. Which process answers, and whether it has built, is its own report (`readiness`,
        which a process Ray restarts answers once it is up), so a restart needs no one to see it happen."""
        if self.standby is None:
            return False
        if self._preparing is not None:
            outcome = _outcome(self._preparing, "could not build its model")
            if outcome == "pending":
                return False  # still building
            self._preparing = None
            self._prepare_failed = outcome == "failed"  # not asked again
        if self._prepare_failed:
            return False
        if self._asking is None:
            self._asking = self.standby.readiness.remote()
        if not ray.wait([self._asking], timeout=READINESS_WAIT_SECONDS)[0]:
            return False  # still starting (or busy): read at the next call
        asked, self._asking = self._asking, None
        try:
            self._standby_built = ray.get(asked) is not None
        except RayActorError:  # lost for good: promoting it would fail
            self._standby_built = False
            return False
        if not self._standby_built:
            self._preparing = self.standby.prepare.remote()
        return self._standby_built

    def _standby_ready(self) -> bool:
        """Whether a lost rank is best replaced by the standby: Ray's state API reports its process alive or,
        without one, the process said it has built its model and no call to it was lost since."""
        if self.standby is None:
            return False
        status = actor_status(self.standby_name)
        if status is not None:
            return status.state == "ALIVE"
        return self._standby_built

    def _follow(self) -> None:
        """Ask the built standby to copy each new image of the shadow's in while it waits (one call in flight,
        asked again where it ended: its shadow restarted, or it failed; a CPU standby then only replays the
        records after the newest image when it is promoted, see `TrainerActor.follow`)."""
        if self._following is not None:  # lost or failed: a promotion copies the image as a restart does
            outcome = _outcome(self._following, "could not copy the shadow's images in advance")
            if outcome == "pending":
                return
            if outcome == "lost":  # its process died: the one Ray restarts says whether it has built
                self._standby_built = False
        self._following = self.standby.follow.remote()

    def form(self) -> None:
        """(Re-)form the ranks' gloo process group: rank 0 offers a fresh port, every rank joins (over
        loopback when `pack` placed them all on one node)."""
        address, port = ray.get(self.leader.group_address.remote(self.job.placement == "pack"))
        ray.get([rank.join_group.remote(address, port) for rank in self.ranks])

    # ------------------------------------------------------------------ training

    def run(self, target: int, step: int) -> tuple[dict[int, TrainerProgress], Failure | None]:
        """Every rank trains from `step` to `target`; (progress by rank, the failure if a rank was lost)."""
        refs = {r: rank.run.remote(target, self.durable_next) for r, rank in enumerate(self.ranks)}
        results, lost = self._gather(refs)
        self.times.add(results, self.k)
        interrupted = [r for r, p in results.items() if p.interrupted is not None]
        if lost or interrupted:
            at = min([p.step for p in results.values()] or [step])
            return results, Failure("trainer_lost", at, f"ranks lost {lost}, interrupted {interrupted}",
                                    ranks=tuple(lost))
        return results, None

    def _gather(self, pending: dict[int, ray.ObjectRef]) -> tuple[dict[int, TrainerProgress], list[int]]:
        """The ranks' results, and the ranks lost. A rank whose process died is lost as soon as Ray's state API
        says so: its call itself fails only after Ray's wait for the death's details, which every software
        failure would otherwise add to its recovery (and does, where the cluster has no state API)."""
        results, lost = {}, []
        poll = DEATH_POLL_SECONDS if actor_states() is not None else None
        while pending:
            done, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=poll)
            for r, ref in list(pending.items()):
                if ref in done:
                    del pending[r]
                    try:
                        results[r] = ray.get(ref)
                    except RayActorError:
                        lost.append(r)
                    except RayTaskError as exc:  # the call reached the rank's restarted process (its node was lost)
                        if not isinstance(exc.cause, RejoinRequiredError):
                            raise
                        lost.append(r)
                elif poll is not None and died_since(self.names[r], self._restarts.get(self.names[r])):
                    del pending[r]  # its call cannot succeed any more
                    lost.append(r)
        return results, sorted(lost)

    # ------------------------------------------------------------------ recovering

    def recover(self, failure: Failure) -> Restored | Failure:
        """Replace the lost ranks and bring every rank to the shadow's step (see the module docstring);
        a failure met on the way (a replacement lost too) comes back as a new `Failure`."""
        marks: list[tuple[str, float]] = []
        lost = sorted(failure.ranks)
        survivors = [r for r in range(self.k) if r not in lost]
        try:
            # Whichever rank died, the survivors hold every record the shadow lacks.
            step = max([call_when_alive(lambda r=r: self.ranks[r].deliver.remote()) for r in survivors],
                       default=None)
            if survivors:
                marks.append(("deliver", time.perf_counter()))
            # The survivors restore (a torn one) meanwhile: off the recovery's critical path.
            rejoined = {r: self.ranks[r].rejoin.remote(step) for r in survivors}
            replaced = {r: self._replace(r, failure.step) for r in lost}
            if lost:
                marks.append((next(iter(replaced.values()))[1], time.perf_counter()))
            rejoined.update({r: actor.rejoin.remote(step, r) for r, (actor, _, _) in replaced.items()})
            infos = {r: ray.get(ref) for r, ref in rejoined.items()}
            marks.append(("rejoin", time.perf_counter()))
        except RayActorError as exc:
            return Failure("trainer_lost", failure.step, f"lost during the recovery: {str(exc).splitlines()[0]}",
                           ranks=tuple(sorted(set(lost) | set(self.lost_ranks()))))
        except _Gone as gone:
            return gone.failure
        if len({info.step for info in infos.values()}) != 1:
            return Failure("trainer_lost", failure.step,
                           f"the ranks rejoined at different steps {[infos[r].step for r in sorted(infos)]}")
        if self.k > 1:
            self.form()
            marks.append(("group", time.perf_counter()))
        self.incarnations = [infos[r].incarnation for r in range(self.k)]
        self._note_restarts()
        rank = lost[0] if lost else 0
        how, constructed = (replaced[rank][1], replaced[rank][2]) if lost else ("torn", None)
        return Restored(rank, infos[rank], how, _phases(failure.seen_at, marks, constructed, infos[rank]))

    def _replace(self, r: int, step: int) -> tuple[object, str, RecoveryInfo | None]:
        """The process that takes lost rank `r`'s place: (actor, `standby` or `restart`, its set-up info)."""
        lost, name = self.ranks[r], self.names[r]
        if self._standby_ready():
            promoted, self.standby = self.standby, lost  # Ray restarts the lost process: the next standby
            self.names[r], self.standby_name = self.standby_name, name
            self._following = self._preparing = self._asking = None
            self._standby_built = self._prepare_failed = False
            self.ranks[r] = promoted
            return promoted, "standby", None
        if self.standby is not None:
            self._drop_unready_standby()
        while True:  # Ray restarts the lost process (a new incarnation): it waits to be told where to restore
            wait_until_restarted(name, self._restarts.get(name))
            try:
                info = call_when_alive(lambda: lost.recovery.remote())
            except RayActorError as exc:
                raise _Gone(Failure("trainer_gone", step, f"rank {r}: {str(exc).splitlines()[0]}"))
            if info.incarnation != self.incarnations[r]:
                return lost, "restart", info
            time.sleep(0.02)

    def lost_ranks(self) -> tuple[int, ...]:
        """The ranks whose process Ray's state API does not report alive now or, without one, whose call
        fails as a lost actor's does (a rank too busy to answer within `PROBE_SECONDS` is alive)."""
        if actor_states() is not None:
            return tuple(r for r in range(self.k)
                         if (status := actor_status(self.names[r])) is None or status.state != "ALIVE")
        probes = [rank.pid.remote() for rank in self.ranks]
        done, _ = ray.wait(probes, num_returns=len(probes), timeout=PROBE_SECONDS)
        lost = []
        for r, ref in enumerate(probes):
            if ref in done:
                try:
                    ray.get(ref)
                except RayActorError:
                    lost.append(r)
        return tuple(lost)

    # ------------------------------------------------------------------ the rest

    def export_to_shadow(self, step: int) -> int | Failure:
        """Rank 0 writes its state into the shadow's intake (a resync); returns its step, or the `Failure` of
        rank 0's loss."""
        try:
            return ray.get(self.leader.export_to_shadow.remote())
        except RayActorError as exc:
            return Failure("trainer_lost", step, str(exc).splitlines()[0], ranks=(0,))

    def resynced(self, step: int) -> None:
        ray.get(self.leader.resynced.remote(step))

    def deliver(self, step: int) -> int | Failure:
        """Every rank hands the shadow the records it holds and the shadow lacks; returns the step the shadow
        then expects (before the step the ranks are at: records no process holds any more), or the `Failure`
        of a lost rank. Raises `ShadowRestartedError` where the shadow went away under the delivery."""
        try:
            return max(call_when_alive(lambda r=rank: r.deliver.remote()) for rank in self.ranks)
        except RayActorError as exc:
            return Failure("trainer_lost", step, str(exc).splitlines()[0], ranks=self.lost_ranks())
        except RayTaskError as exc:
            raise ShadowRestartedError(f"the shadow went away during a delivery: {exc.cause or exc}") from exc

    def state_hashes(self, step: int) -> list[tuple[int, str]] | Failure:
        """Every rank's (step, state_hash), in rank order; a `Failure` when a rank was lost (or waits to
        rejoin: Ray restarted its process) since every rank reached `step`."""
        refs = [rank.state_hash.remote() for rank in self.ranks]
        hashes, lost = [], []
        for r, ref in enumerate(refs):
            try:
                hashes.append(ray.get(ref))
            except RayActorError:
                lost.append(r)
            except RayTaskError as exc:
                if not isinstance(exc.cause, RejoinRequiredError):
                    raise
                lost.append(r)
        if lost:
            return Failure("trainer_lost", step, f"ranks lost {lost}", ranks=tuple(lost))
        return hashes

    def resent_records(self) -> int:
        return ray.get(self.leader.publisher_stats.remote()).resent_records

    def kernel(self) -> KernelInfo:
        """Which implementation rank 0 updates the weights with."""
        return ray.get(self.leader.kernel.remote())

    def kill(self) -> list:
        """End every trainer process of the run (no restart); returns the actors, for a wait on their deaths."""
        actors = self.all_actors()
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # gone already
                pass
        return actors


def _outcome(call: ray.ObjectRef, failed: str) -> str:
    """How a call to the standby ended, without waiting: `pending`, `done`, `lost` (its process died) or
    `failed` (it raised: logged as "the standby `failed`: ...")."""
    if not ray.wait([call], timeout=0)[0]:
        return "pending"
    try:
        ray.get(call)
        return "done"
    except RayActorError:
        return "lost"
    except RayError as exc:
        logger.warning("the standby %s: %s", failed, str(exc).splitlines()[0])
        return "failed"


class _Gone(Exception):
    """A lost rank cannot come back: carries the failure out of `recover`."""

    def __init__(self, failure: Failure):
        super().__init__(failure.detail)
        self.failure = failure


def _phases(started: float, marks: list[tuple[str, float]], constructed: RecoveryInfo | None,
            restored: RecoveryInfo) -> dict[str, float]:
    """`Recovery.phases`: the seconds of each step of a recovery, in order, and the replacement process's
    constructor (a restarted one's) and restore (parts of `restart` and `rejoin`)."""
    phases, last = {}, started
    for name, at in marks:
        phases[name], last = at - last, at
    if constructed is not None and constructed.seconds is not None:
        phases["constructor"] = constructed.seconds
    if restored.restore_seconds is not None:
        phases["restore"] = restored.restore_seconds
        if "rejoin" in phases and restored.seconds is not None:
            # the rejoin call's time outside the process's restore: the call's way there and back, and its wait
            # behind a copy the process had begun (a standby's copy of a new image, `TrainerActor.follow`)
            phases["waited"] = max(phases["rejoin"] - restored.seconds, 0.0)
    for name in ("fetch", "install", "copy", "replay", "hash"):
        seconds = getattr(restored, f"{name}_seconds")
        if seconds is not None:
            phases[name] = seconds
    return phases
