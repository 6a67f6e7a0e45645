"""`TrainerGroup`: a run's trainer processes, driven and recovered together.

A single trainer is a group of one; data parallel is k ranks in one gloo process group.
`run` returns a lost rank as a `Failure` value, so the controller decides what to do.
`recover` replaces a lost rank by the ready standby or Ray's restart, and rejoins every rank
at the shadow's step.
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
from zocheck_ray.runtime.errors import RejoinRequiredError, ShadowRestartedError
from zocheck_ray.config import JobConfig
from zocheck_ray.control.outcomes import Restored, StepTimes
from zocheck_ray.control.summary import GroupChange
from zocheck_ray.runtime.parallel.shards import assign, shard_count
from zocheck_ray.control.policy import Failure
from zocheck_ray.workload.errors import WorkloadError

logger = logging.getLogger(__name__)


DEATH_POLL_SECONDS = 0.1
"""Seconds between a segment's state-API checks for a dead rank."""
READINESS_WAIT_SECONDS = 0.05
"""Seconds `prepare_standby` waits for the standby's report before asking again at its next call."""
PROBE_SECONDS = 5.0
"""Seconds `lost_ranks` waits for answers without a state API."""


class TrainerGroup:
    """The trainer ranks of a run and its optional warm standby."""

    def __init__(self, job: JobConfig, ranks: list, start_standby: Callable[[str], object] | None = None,
                 names: list[str] | None = None):
        self.job = job
        self.k = len(ranks)
        self.ranks = list(ranks)
        self.names = list(names) if names is not None else [trainer_name(job.run_id, r) for r in range(self.k)]
        self.standby_name = trainer_name(job.run_id, "standby")
        self.incarnations: list[str | None] = [None] * self.k
        self._start_standby = start_standby
        self._standbys_started = 0
        """Each standby gets its own name, as an ended one may not be gone yet."""
        self.standby = None
        self._new_standby()
        self.durable_next: int | None = None
        """Records before this step are durable, so the ranks drop them."""
        self._restarts: dict[str, int] = {}
        """Restart counts by actor name: a lost actor is back once its count grows."""
        self.times = StepTimes([0.0] * self.k, [0] * self.k)
        self.held = assign(shard_count(job), self.k)
        """Each rank's shards."""
        self.changes: list[GroupChange] = []
        """Each shrink and join of an elastic group."""
        self.key: tuple[str, int] | None = None
        """The ranks' process group's rendezvous (address, port)."""
        self._refused: tuple[int, WorkloadError] | None = None
        """A rank whose segment raised on the user's data or functions (`WorkloadError`), and the error."""

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
        """Give every rank its first state; returns rank 0's."""
        infos = [call_when_alive(lambda rank=rank: rank.recovery.remote()) for rank in self.ranks]
        if any(info.step != infos[0].step for info in infos[1:]):  # a rank asked before rank 0 initialized
            infos[1:] = ray.get([rank.rejoin.remote(infos[0].step) for rank in self.ranks[1:]])
        self.incarnations = [info.incarnation for info in infos]
        self._first_group()
        self._note_restarts()
        return infos[0]

    def _first_group(self) -> None:
        if self.k > 1:
            self.form()

    def _note_restarts(self) -> None:
        self._restarts = {name: status.restarts for name in self.all_names()
                          if (status := actor_status(name)) is not None}

    def start_standby(self) -> None:
        """Start the warm standby, or move it on (build, then follow the shadow's images)."""
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
        """`none`, `starting` or `ready`, as `status` reports it."""
        if self.standby is None:
            return "none"
        return "ready" if self._standby_built else "starting"

    def trainer_times(self) -> TrainerTimes | None:
        """The last segment's step times and the standby's state, for the shadow's metrics."""
        recent = self.times.recent
        if recent is None:
            return None
        last = self.changes[-1] if self.changes else None
        return recent.model_copy(update={
            "standby": self.standby_state(), "ranks": self.k, "rank_shards": [list(h) for h in self.held],
            "group_changes": len(self.changes),
            "last_group_change": None if last is None else f"{last.kind} at step {last.step} to {last.ranks} ranks "
                                                           f"({last.cause}), the others stalled "
                                                           f"{last.stall_seconds:.3f} s"})

    def _drop_unready_standby(self) -> None:
        """End a standby still building when a rank is lost, so that its set-up leaves the cores to
        Ray's restart."""
        try:
            ray.kill(self.standby, no_restart=True)
        except Exception:  # gone already
            pass
        logger.info("the standby was not ready when a rank was lost: ended, to leave the cores to the restart")
        self.standby = None
        self._new_standby()

    def _new_standby(self) -> None:
        """Forget the calls to the standby that was: the next one (or none) starts with none in flight."""
        self._following = self._preparing = self._asking = None
        self._standby_built = self._prepare_failed = False

    def prepare_standby(self) -> bool:
        """Ask the standby to build its model; True once it has, by the process's own report, so its
        restart needs no watching."""
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
        """Whether the standby is ready to replace a lost rank."""
        if self.standby is None:
            return False
        status = actor_status(self.standby_name)
        if status is not None:
            return status.state == "ALIVE"
        return self._standby_built

    def _follow(self) -> None:
        """Keep one `follow` call in flight: the standby copies each new image in while it waits."""
        if self._following is not None:  # lost or failed: a promotion copies the image as a restart does
            outcome = _outcome(self._following, "could not copy the shadow's images in advance")
            if outcome == "pending":
                return
            if outcome == "lost":  # its process died: the one Ray restarts says whether it has built
                self._standby_built = False
        self._following = self.standby.follow.remote()

    def form(self) -> None:
        """(Re-)form the ranks' gloo process group on a fresh port of rank 0's."""
        address, port = ray.get(self.leader.group_address.remote(self.job.scaling.placement == "pack"))
        ray.get([rank.join_group.remote(address, port) for rank in self.ranks])
        self.key = (address, port)

    # ------------------------------------------------------------------ training

    def run(self, target: int, step: int) -> tuple[dict[int, TrainerProgress], Failure | None]:
        """Train every rank from `step` to `target`; returns (progress by rank, the failure or None)."""
        refs = {r: rank.run.remote(target, self.durable_next) for r, rank in enumerate(self.ranks)}
        self._refused = None
        results, lost = self._gather(refs)
        if self._refused is not None:  # the user's data or function, not the process: a restart would meet it again
            rank, error = self._refused
            return results, Failure("input_refused", min([p.step for p in results.values()] or [step]),
                                    f"rank {rank}: {error}")
        lost = self._settle(results, step, lost)
        self.times.add(results, self.k)
        interrupted = [r for r, p in results.items() if p.interrupted is not None]
        if lost or interrupted:
            at = min([p.step for p in results.values()] or [step])
            return results, Failure("trainer_lost", at, f"ranks lost {lost}, interrupted {interrupted}",
                                    ranks=tuple(lost))
        return results, None

    def _gather(self, pending: dict[int, ray.ObjectRef]) -> tuple[dict[int, TrainerProgress], list[int]]:
        """The ranks' results and the lost ranks. Polls the state API, because a dead rank's call fails
        only after Ray's wait for death details."""
        results, lost = {}, []
        poll = DEATH_POLL_SECONDS if actor_states() is not None else None
        while pending:
            done, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=poll)
            self._collect(pending, done, results, lost, poll is not None)
        return results, sorted(lost)

    def _collect(self, pending: dict, done: list, results: dict, lost: list, polled: bool) -> None:
        """Move the finished calls of `pending` to `results` or `lost` (also one the state API calls dead)."""
        for r, ref in list(pending.items()):
            if ref in done:
                del pending[r]
                try:
                    results[r] = ray.get(ref)
                except RayActorError:
                    lost.append(r)
                except RayTaskError as exc:  # the call reached the rank's restarted process (its node was lost)
                    if isinstance(exc.cause, WorkloadError):
                        self._refused = r, exc.cause
                        continue
                    if not isinstance(exc.cause, RejoinRequiredError):
                        raise
                    lost.append(r)
            elif polled and died_since(self.names[r], self._restarts.get(self.names[r])):
                del pending[r]  # its call cannot succeed any more
                lost.append(r)

    def _settle(self, results: dict[int, TrainerProgress], step: int, lost: list[int]) -> list[int]:
        """After a segment's calls: the lost ranks (an elastic group also settles its changes)."""
        return lost

    # ------------------------------------------------------------------ recovering

    def recover(self, failure: Failure) -> Restored | Failure:
        """Replace the lost ranks and rejoin every rank at the shadow's step, or a new `Failure`."""
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
            rejoined = {r: self.ranks[r].rejoin.remote(step, r, self.k) for r in survivors}
            replaced = {r: self._replace(r, failure.step) for r in lost}
            if lost:
                marks.append((next(iter(replaced.values()))[1], time.perf_counter()))
            rejoined.update({r: actor.rejoin.remote(step, r, self.k) for r, (actor, _, _) in replaced.items()})
            infos = {r: ray.get(ref) for r, ref in rejoined.items()}
            marks.append(("rejoin", time.perf_counter()))
        except RayActorError as exc:
            return Failure("trainer_lost", failure.step, f"lost during the recovery: {str(exc).splitlines()[0]}",
                           ranks=tuple(sorted(set(lost) | set(self.lost_ranks()))))
        except _Gone as gone:
            return gone.failure
        except RayTaskError as exc:  # a restarted process refused the run's input (its model_init, say)
            if not isinstance(exc.cause, WorkloadError):
                raise
            return Failure("input_refused", failure.step, f"rank {lost[0] if lost else 0}: {exc.cause}")
        if len({info.step for info in infos.values()}) != 1:
            return Failure("trainer_lost", failure.step,
                           f"the ranks rejoined at different steps {[infos[r].step for r in sorted(infos)]}")
        if self.k > 1:
            self.form()
            marks.append(("group", time.perf_counter()))
        self.incarnations = [infos[r].incarnation for r in range(self.k)]
        self.held = assign(shard_count(self.job), self.k)  # as every rank took it on rejoining
        self._note_restarts()
        rank = lost[0] if lost else 0
        how, constructed = (replaced[rank][1], replaced[rank][2]) if lost else ("torn", None)
        return Restored(rank, infos[rank], how, _phases(failure.seen_at, marks, constructed, infos[rank]))

    def _replace(self, r: int, step: int) -> tuple[object, str, RecoveryInfo | None]:
        """(actor, how, its set-up info) of the process taking lost rank `r`'s place."""
        lost, name = self.ranks[r], self.names[r]
        if self._standby_ready():
            promoted, self.standby = self.standby, lost  # Ray restarts the lost process: the next standby
            self.names[r], self.standby_name = self.standby_name, name
            self._new_standby()
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

    def grow(self, step: int) -> GroupChange | Failure | None:
        """At a step boundary, take back a lost rank (an elastic group); None: no change."""
        return None

    def lost_ranks(self) -> tuple[int, ...]:
        """The ranks not alive now, by the state API or, without one, by a probe call."""
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
        """Resync: rank 0 writes its state to the shadow; returns its step, or the `Failure` of its loss."""
        try:
            return ray.get(self.leader.export_to_shadow.remote())
        except RayActorError as exc:
            return Failure("trainer_lost", step, str(exc).splitlines()[0], ranks=(0,))

    def resynced(self, step: int) -> None:
        ray.get(self.leader.resynced.remote(step))

    def deliver(self, step: int) -> int | Failure:
        """Hand the shadow the records it lacks; returns the step it then expects, or a lost rank's
        `Failure`. Raises `ShadowRestartedError` if the shadow went away."""
        try:
            return max(call_when_alive(lambda r=rank: r.deliver.remote()) for rank in self.ranks)
        except RayActorError as exc:
            return Failure("trainer_lost", step, str(exc).splitlines()[0], ranks=self.lost_ranks())
        except RayTaskError as exc:
            raise ShadowRestartedError(f"the shadow went away during a delivery: {exc.cause or exc}") from exc

    def state_hashes(self, step: int) -> list[tuple[int, str]] | Failure:
        """Every rank's (step, state_hash), in rank order, or a `Failure` if a rank was lost since `step`."""
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
        """End every trainer process (no restart); returns the actors, to wait on their deaths."""
        actors = self.all_actors()
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # gone already
                pass
        return actors


def _outcome(call: ray.ObjectRef, failed: str) -> str:
    """How a standby call ended, without waiting: `pending`, `done`, `lost` or `failed` (logged)."""
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
    """`Recovery.phases` from the marks and the replacement's own timings."""
    phases, last = {}, started
    for name, at in marks:
        phases[name], last = at - last, at
    if constructed is not None and constructed.seconds is not None:
        phases["constructor"] = constructed.seconds
    if restored.restore_seconds is not None:
        phases["restore"] = restored.restore_seconds
        if "rejoin" in phases and restored.seconds is not None:
            # the call's round trip, and its wait behind a copy the standby had begun
            phases["waited"] = max(phases["rejoin"] - restored.seconds, 0.0)
    for name in ("fetch", "install", "copy", "replay", "hash"):
        seconds = getattr(restored, f"{name}_seconds")
        if seconds is not None:
            phases[name] = seconds
    return phases
