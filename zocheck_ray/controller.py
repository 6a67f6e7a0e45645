"""The driver side: placement, the startup profile, monitoring, resyncs and failures.

    import zocheck_ray
    summary = zocheck_ray.run(zocheck_ray.JobConfig(steps=100), fail_at=[40])

The trainer and the shadow share a STRICT_PACK placement group (one node). The
controller is a state machine (`State`): it starts the actors, profiles, then drives
the trainer in segments of `log_interval` steps; between segments it reads the
shadow's metrics and prints a progress line. Everything that goes wrong becomes a
`Failure`, and one function, `decide`, turns it into what happens next: wait for
Ray's restart of the trainer (which recovers in its constructor), resync the shadow
from the trainer, or fail the run with a clear error.

Data parallel (`trainers: k`): the controller drives all k ranks segment by segment;
a segment call that fails is the step boundary. A lost rank becomes `rank_lost`
(RESTART): the survivors hand the shadow the records it lacks, Ray restarts the lost
rank, every rank rejoins at the shadow's step (from its image plus records), the
process group is formed again, and training resumes, exactly.
"""

from __future__ import annotations

import enum
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Literal

import ray
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, remove_placement_group

from zocheck_ray.actors.ray_actors import call_when_alive, shadow_writer, wait_until_alive
from zocheck_ray.actors.trainer import RejoinRequiredError
from zocheck_ray.config import JobConfig, JobConfigError, check_task
from zocheck_ray.faults import NO_FAULTS, FaultInjection
from zocheck_ray.storage import LeaseHeldError, StorageError, check_no_live_writer
from zocheck_ray.storage.fs import open_storage, parse_url
from zocheck_ray.placement import (
    _check_resources, _lose_processes, connect_ray, profile_settings, start_actors, startup_profile,
)
from zocheck_ray.summary import Recovery, RunFailedError, RunSummary


class State(enum.Enum):
    STARTING = "starting"
    PROFILING = "profiling"
    RUNNING = "running"
    RECOVERING = "recovering"
    RESYNCING = "resyncing"
    FINISHING = "finishing"
    DONE = "done"
    FAILED = "failed"


class Action(enum.Enum):
    RESTART = "restart"    # Ray restarts the trainer (or a lost rank); wait for it to recover
    RESYNC = "resync"      # copy the trainer's state into the shadow
    FAIL = "fail"          # end the run with a clear error


@dataclass(frozen=True)
class Failure:
    kind: Literal["trainer_lost", "rank_lost", "trainer_gone", "shadow_gone", "shadow_lag", "replay_error",
                  "record_gap",
                  "durability_stalled", "writer_lost", "drain_failed"]
    step: int
    detail: str
    mode: str = "unplanned"
    """For a lost trainer: `software`, `host` (injected) or `unplanned`."""
    ranks: tuple[int, ...] = ()
    """For `rank_lost`: the data-parallel ranks whose processes were lost (none: only the collective broke)."""


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


def decide(failure: Failure, job: JobConfig) -> Decision:
    """The one place where a failure becomes what happens next."""
    kind = failure.kind
    if kind == "trainer_lost":
        return Decision(Action.RESTART, "Ray restarts the trainer, which recovers from the shadow's image")
    if kind == "rank_lost":
        return Decision(Action.RESTART, "the other ranks stop at the step boundary and hand the shadow its missing "
                                        "records; Ray restarts the lost rank; every rank rejoins at the shadow's "
                                        "step and the process group is formed again")
    if kind in ("shadow_lag", "replay_error", "record_gap"):
        return Decision(Action.RESYNC, {"shadow_lag": f"the shadow lags more than {job.max_lag_steps} steps",
                                        "replay_error": "the shadow's replay stopped",
                                        "record_gap": "the shadow lacks records no process holds"}[kind])
    if kind == "durability_stalled":
        return Decision(Action.FAIL, f"{failure.detail}; the run stops rather than go on without durability "
                                     f"(max_undurable_steps={job.max_undurable_steps}): fix the storage at "
                                     f"{job.run_url} and run the same job again to resume")
    if kind == "writer_lost":
        return Decision(Action.FAIL, f"{failure.detail}; one writer per run: stop the other writer or give this "
                                     "job another run_id or storage")
    if kind == "trainer_gone":
        return Decision(Action.FAIL, f"the trainer cannot be restarted ({failure.detail}); raise max_restarts "
                                     f"(now {job.max_restarts}) or look at the trainer's log")
    if kind == "shadow_gone":
        return Decision(Action.FAIL, f"the shadow cannot be restarted ({failure.detail}); the durable state "
                                     f"under {job.run_url} resumes the run")
    return Decision(Action.FAIL, failure.detail)


class Controller:
    """Drives one run through its states; `run()` is the facade."""

    def __init__(self, job: JobConfig, task, gpus: int, fail_at: list[int], fail_mode: str,
                 say: Callable[[str], None], kill_node: Callable[[], None] | None,
                 placement_group: PlacementGroup | None, first_bundle: int,
                 on_segment: Callable[[dict, dict], None] | None, faults: FaultInjection, fail_rank: int = 0):
        self.job, self.task, self.gpus, self.say, self.faults = job, task, gpus, say, faults
        self.fail_rank = fail_rank
        self.failures = sorted(set(fail_at))
        self.fail_mode, self.kill_node = fail_mode, kill_node
        self.given_pg, self.first_bundle, self.on_segment = placement_group, first_bundle, on_segment
        self.state = State.STARTING
        self.states: list[str] = []
        self.trainer = self.shadow = None
        self.groups: list[PlacementGroup] = []
        self.ranks: list = []
        """The trainer actor of each data-parallel rank (`self.trainer` is rank 0)."""
        self.rank_incarnations: list[str | None] = []
        self.rank_seconds = [0.0] * job.trainers
        self.rank_steps = [0] * job.trainers
        self.collective_seconds, self.collective_steps = 0.0, 0
        self.recent_rank_seconds: list[float] = []
        """Each rank's mean step seconds over the last segment (reported to the shadow, so `status` shows it)."""
        self.recent_collective: float | None = None
        self.durable_next: int | None = None
        """Every record before this step is durable (the holding ranks drop them)."""
        self.resync_reason = ""
        self._failure_started: float | None = None
        self.step = 0
        self.incarnation = None
        self.shadow_incarnation = None
        self.shadow_restarts = 0
        self.failure: Failure | None = None
        self.error: str | None = None
        self.recoveries: list[Recovery] = []
        self.resyncs: list[tuple[int, str]] = []
        self.warnings: list[str] = []
        self._warned_durability = False
        # On an object store a log segment is uploaded once it holds `log_seal_records` records (or is 60 s old):
        # that many steps are not durable by design, and do not count against `max_undurable_steps`.
        self.seal_window = 0 if parse_url(job.run_url)[0] == "file" else job.log_seal_records
        self.losses: list[tuple[int, float]] = []
        self.profile: dict | None = None
        self.max_lag_steps = job.max_lag_steps or DEFAULT_MAX_LAG_STEPS
        self.steps_timed, self.seconds_timed = 0, 0.0
        self.step_hashes: dict[int, str] = {}
        self.lag_samples: list[tuple[int, int]] = []
        self.evaluations: dict[int, dict[str, float]] = {}
        self.eval_seconds = 0.0
        self.last: dict | None = None
        self.resumed_from: int | None = None
        self.summary: RunSummary | None = None

    # ------------------------------------------------------------------ the machine

    def run(self) -> RunSummary:
        handlers = {State.STARTING: self._start, State.PROFILING: self._profile, State.RUNNING: self._segment,
                    State.RECOVERING: self._recover, State.RESYNCING: self._resync, State.FINISHING: self._finish}
        try:
            while self.state not in (State.DONE, State.FAILED):
                self.states.append(self.state.value)
                try:
                    self.state = handlers[self.state]()
                except _Gone as gone:
                    self.state = self._handle(gone.failure)
        finally:
            self._stop_actors()
        self.states.append(self.state.value)
        if self.state is State.FAILED:
            raise RunFailedError(f"run {self.job.run_id} failed at step {self.step}: {self.error}")
        return self.summary

    def _handle(self, failure: Failure) -> State:
        decision = decide(failure, self.job)
        self.failure = failure
        if decision.action is Action.RESTART:
            return State.RECOVERING
        if decision.action is Action.RESYNC:
            self.resync_reason = decision.reason
            return State.RESYNCING
        self.error = decision.reason
        self.say(f"  FAILED: {decision.reason}")
        return State.FAILED

    # ------------------------------------------------------------------ states

    def _start(self) -> State:
        job = self.job
        self.groups, self.shadow, self.ranks = start_actors(job, self.gpus, self.given_pg, self.first_bundle,
                                                            self.faults)
        self.trainer = self.ranks[0]
        self.say(f"run {job.run_id}: {job.model} {job.dtype} {job.zo.optimizer}, {job.steps} steps, "
                 f"storage {job.run_url}")
        task = self.task
        self.say(f"  task {task.config.kind}: {task.n_train} training rows, {task.n_eval} held-out rows "
                 f"({task.metric}), batch {task.config.batch_size}, {task.tokenizer.describe()}")
        started_from = call_when_alive(lambda: self.trainer.recovery.remote())
        self.incarnation = started_from["incarnation"]
        if job.trainers > 1:
            others = [call_when_alive(lambda: rank.recovery.remote()) for rank in self.ranks[1:]]
            self.rank_incarnations = [started_from["incarnation"]] + [o["incarnation"] for o in others]
            if any(o["step"] != started_from["step"] for o in others):  # a rank asked before rank 0 had
                ray.get([rank.rejoin.remote(started_from["step"]) for rank in self.ranks[1:]])  # initialized
            self._form_group()
            self.say(f"  {job.trainers} data-parallel ranks ({job.placement}), batch slices of "
                     f"{job.task.batch_size // job.trainers} rows, gloo process group formed")
        if started_from["source"] != "fresh":
            self.resumed_from = self.step = started_from["step"]
            self.say(f"  resumed from the {started_from['source']} image at step {self.step}")
        self.shadow_incarnation = self._metrics()["incarnation"]
        return State.PROFILING if job.snapshot_interval is None and self.step < job.steps else State.RUNNING

    def _profile(self) -> State:
        report = startup_profile(self.job, self.trainer, self.shadow, self._absorb, first_step=self.step,
                                 train_to=self._train_all if self.job.trainers > 1 else None)
        self.step += report.training_steps
        self.profile = report.model_dump(mode="json")
        if self.job.max_lag_steps is None and report.plan.lag_bound_steps:
            self.max_lag_steps = max(1, int(report.plan.lag_bound_steps))
        self.say(f"  profile ({report.training_steps} steps, {report.profile_seconds:.1f} s): trainer step "
                 f"{report.timings.gpu_step_seconds * 1e3:.1f} ms, replay {report.timings.replay_step_seconds * 1e3:.2f} "
                 f"ms on {report.replay_threads} threads, snapshot {report.timings.snapshot_cost_seconds * 1e3:.2f} ms, "
                 f"persist {report.timings.persist_seconds * 1e3:.0f} ms: {report.plan.regime} regime, "
                 f"snapshot every {report.snapshot_interval} steps, resync beyond {self.max_lag_steps} steps of lag")
        return State.RUNNING

    def _segment(self) -> State:
        job = self.job
        if self.step >= job.steps:
            return State.FINISHING
        target = min(job.steps, (self.step // job.log_interval + 1) * job.log_interval)
        fail = self.failures[0] if self.failures and self.step < self.failures[0] <= target else None
        if fail is not None:
            return self._inject(fail)
        if job.trainers > 1:
            return self._segment_ranks(target)
        began = time.perf_counter()
        try:
            last = ray.get(self.trainer.run.remote(target))
        except RayActorError as exc:  # a failure nobody injected
            return self._handle(Failure("trainer_lost", self.step, str(exc).splitlines()[0]))
        return self._after_segment(last, began)

    def _after_segment(self, last: dict, began: float) -> State:
        elapsed = time.perf_counter() - began - self._absorb(last)
        if self.job.trainers == 1 and last["step_seconds"]:
            self.recent_rank_seconds = [statistics.fmean(last["step_seconds"])]
        self.steps_timed += last["step"] - self.step
        self.seconds_timed += elapsed
        self.step, self.last = last["step"], last
        self.losses.append((self.step, last["loss"]))
        metrics = self._metrics()
        failure = self._check(metrics, last)
        if failure is not None:
            return self._handle(failure)
        self.lag_samples.append((self.step, metrics["lag_steps"]))
        if metrics["durable_log_step"] is not None:
            self.durable_next = metrics["durable_log_step"] + 1
        if self.on_segment is not None:
            self.on_segment(last, metrics)
        evaluated = max(last.get("evaluations") or {}, default=None)
        held_out = (f"  held-out {self.task.metric} {last['evaluations'][evaluated][self.task.metric]:.4f}"
                    if evaluated is not None else "")
        self.say(f"  step {self.step:5d}  loss {last['loss']:.4f}  lag {metrics['lag_steps']:3d}  "
                 f"snapshot {metrics['snapshot_step']}  durable {metrics['durable_step']}{held_out}")
        return State.RUNNING

    def _inject(self, fail: int) -> State:
        self.failures.pop(0)
        if self.job.trainers > 1:
            self.say(f"  injected failure at step {fail}: rank {self.fail_rank}'s process exits")
            results, lost = self._run_ranks(fail + 1, die=(self.fail_rank, fail))
            if 0 in results:
                self._absorb(results[0])
            if self.fail_rank not in lost:
                raise RuntimeError(f"rank {self.fail_rank} survived its injected failure at step {fail}")
            self._failure_started = time.perf_counter()
            return self._handle(Failure("rank_lost", fail, "injected", mode="software", ranks=tuple(lost)))
        self.say(f"  injected failure at step {fail}: {INJECTED[self.fail_mode]}")
        if self.fail_mode == "software":
            try:
                ray.get(self.trainer.run.remote(fail + 1, fail))  # the trainer process exits at `fail`
            except RayActorError:
                return self._handle(Failure("trainer_lost", fail, "injected", mode="software"))
            raise RuntimeError(f"the trainer survived its injected failure at step {fail}")
        self._absorb(ray.get(self.trainer.run.remote(fail)))
        self.step = fail
        if self.fail_mode == "shadow":  # the shadow process dies; Ray restarts it from durable storage
            ray.kill(self.shadow, no_restart=False)
            return State.RUNNING
        self._failure_started = time.perf_counter()
        (self.kill_node or _lose_processes(self.trainer, self.shadow))()
        return self._handle(Failure("trainer_lost", fail, "injected", mode="host"))

    def _check(self, metrics: dict, progress: dict) -> Failure | None:
        """What the segment's metrics say is wrong, if anything; warnings are printed here."""
        job = self.job
        if metrics["incarnation"] != self.shadow_incarnation:
            self.shadow_incarnation = metrics["incarnation"]
            self.shadow_restarts += 1
            self._warn(f"the shadow restarted (it came back from durable storage); the trainer re-sends what it "
                       f"lacks ({progress['publisher']['resent_records']} records so far)")
        if metrics["persist_stopped"]:
            return Failure("writer_lost", self.step, metrics["persist_error"])
        if metrics["replay_error"]:
            return Failure("replay_error", self.step, metrics["replay_error"])
        if progress["publisher"]["gap"]:
            return Failure("record_gap", self.step, progress["publisher"]["gap"])
        undurable = metrics["undurable_steps"]
        behind = undurable - self.seal_window  # beyond what an object store's open segment holds by design
        if behind > job.max_undurable_steps:
            return Failure("durability_stalled", self.step,
                           f"{undurable} steps are not durable in {job.run_url} (last storage error: "
                           f"{metrics['persist_error'] or 'none; storage is too slow'})")
        if (behind > job.max_undurable_steps // 10 or metrics["persist_error"]) and not self._warned_durability:
            self._warned_durability = True
            self._warn(f"durability is behind: {undurable} steps not durable in {job.run_url}, "
                       f"{metrics['persist_failures']} failed writes (last: {metrics['persist_error'] or 'none'}); "
                       f"the run fails beyond {job.max_undurable_steps + self.seal_window}")
        elif self._warned_durability and not metrics["persist_error"] and behind <= job.max_undurable_steps // 10:
            self._warned_durability = False
            self._warn(f"durability caught up: {undurable} steps not durable")
        if metrics["lag_steps"] > self.max_lag_steps:
            return Failure("shadow_lag", self.step, f"lag {metrics['lag_steps']} steps")
        return None

    # ------------------------------------------------------------------ data parallel

    def _form_group(self) -> None:
        """(Re-)form the ranks' gloo process group: rank 0 offers a fresh port, every rank joins (over
        loopback when `pack` placed them all on one node)."""
        address, port = ray.get(self.trainer.group_address.remote(self.job.placement == "pack"))
        ray.get([rank.join_group.remote(address, port) for rank in self.ranks])

    def _run_ranks(self, target: int, die: tuple[int, int] | None = None) -> tuple[dict[int, dict], list[int]]:
        """Every rank trains to `target` (`die`: (rank, step) exits there); (progress by rank, lost ranks)."""
        refs = [rank.run.remote(target, die[1] if die and die[0] == r else None, self.durable_next)
                for r, rank in enumerate(self.ranks)]
        results, lost = {}, []
        for r, ref in enumerate(refs):
            try:
                results[r] = ray.get(ref)
            except RayActorError:
                lost.append(r)
            except RayTaskError as exc:  # the call reached the rank's restarted process (its node was lost)
                if not isinstance(exc.cause, RejoinRequiredError):
                    raise
                lost.append(r)
        for r, progress in results.items():
            self.rank_seconds[r] += sum(progress["step_seconds"])
            self.rank_steps[r] += len(progress["step_seconds"])
            self.collective_seconds += sum(progress["collective_seconds"])
            self.collective_steps += len(progress["collective_seconds"])
            self._absorb_ranks(r, progress)
        if len(results) == len(self.ranks) and all(p["step_seconds"] for p in results.values()):
            self.recent_rank_seconds = [statistics.fmean(results[r]["step_seconds"]) for r in range(len(self.ranks))]
            gathers = [s for p in results.values() for s in p["collective_seconds"]]
            self.recent_collective = statistics.fmean(gathers) if gathers else None
        return results, lost

    def _absorb_ranks(self, rank: int, progress: dict) -> None:
        """Step hashes from every rank: equal for every step, or the replicas diverged (a warning)."""
        for step, digest in (progress.get("step_hashes") or {}).items():
            seen = self.step_hashes.setdefault(step, digest)
            if seen != digest:
                self._warn(f"rank {rank}'s state after step {step} differs from another rank's")

    def _train_all(self, step: int) -> dict:
        results, lost = self._run_ranks(step)
        if lost or any(p["interrupted"] is not None for p in results.values()):
            raise RunFailedError(f"a rank was lost during the startup profile (ranks {lost}); run again, or set "
                                 "snapshot_interval to skip the profile")
        return results[0]

    def _segment_ranks(self, target: int) -> State:
        began = time.perf_counter()
        results, lost = self._run_ranks(target)
        interrupted = [r for r, p in results.items() if p["interrupted"] is not None]
        if lost or interrupted:  # a failure nobody injected
            self._failure_started = time.perf_counter()
            self.step = min([p["step"] for p in results.values()] or [self.step])
            return self._handle(Failure("rank_lost", self.step, f"ranks lost {lost}, interrupted {interrupted}",
                                        ranks=tuple(lost)))
        return self._after_segment(results[0], began)

    def _recover_ranks(self) -> State:
        failure = self.failure
        started = self._failure_started or time.perf_counter()
        self._failure_started = None
        lost = set(failure.ranks)
        survivors = [r for r in range(self.job.trainers) if r not in lost]
        # Whichever rank died, the survivors hold every record the shadow lacks.
        delivered = [call_when_alive(lambda r=r: self.ranks[r].deliver.remote()) for r in survivors]
        step = max(delivered) if survivors else None
        marks = [("deliver", time.perf_counter())]
        # The survivors rejoin (a rank the failed gather left half-perturbed restores) while Ray restarts
        # the lost rank: off the recovery's critical path.
        rejoined = {r: self.ranks[r].rejoin.remote(step) for r in survivors}
        restarted = {}
        for r in sorted(lost):  # wait for Ray's restart of the lost rank (a new incarnation)
            while True:
                wait_until_alive(self.ranks[r])
                try:
                    info = call_when_alive(lambda r=r: self.ranks[r].recovery.remote())
                except RayActorError as exc:
                    return self._handle(Failure("trainer_gone", failure.step, f"rank {r}: "
                                                + str(exc).splitlines()[0]))
                if info["incarnation"] != self.rank_incarnations[r]:
                    restarted[r] = info
                    break
                time.sleep(0.02)
        marks.append(("restart", time.perf_counter()))
        rejoined.update({r: self.ranks[r].rejoin.remote(step) for r in sorted(lost)})
        infos = ray.get([rejoined[r] for r in range(len(self.ranks))])
        marks.append(("rejoin", time.perf_counter()))
        if len({info["step"] for info in infos}) != 1:
            return self._handle(Failure("rank_lost", failure.step, "the ranks rejoined at different steps "
                                        f"{[info['step'] for info in infos]}"))
        self._form_group()
        marks.append(("group", time.perf_counter()))
        self.rank_incarnations = [info["incarnation"] for info in infos]
        self.incarnation = self.rank_incarnations[0]
        seconds = marks[-1][1] - started
        rank = min(lost) if lost else 0
        info = infos[rank]
        self.recoveries.append(Recovery(failed_at_step=failure.step, mode=failure.mode, recovered_step=info["step"],
                                        seconds=seconds, image_source=info["source"],
                                        image_step=info.get("image_step"),
                                        replayed_records=info["replayed_records"], rank=rank,
                                        phases=_phases(started, marks, restarted.get(rank), info)))
        self.say(f"  rank {rank} lost at step {failure.step} ({failure.mode}); {len(survivors)} survivors handed "
                 f"the shadow its records; every rank rejoined at step {info['step']} (rank {rank} from the "
                 f"{info['source']} image, {info['replayed_records']} records replayed) in {seconds:.2f} s")
        self.step = info["step"]
        if info.get("state_hash"):
            self.step_hashes[self.step] = info["state_hash"]
        return State.RUNNING

    def _recover(self) -> State:
        if self.job.trainers > 1:
            return self._recover_ranks()
        failure = self.failure
        started = self._failure_started or time.perf_counter()
        self._failure_started = None
        while True:  # until the restarted trainer (a new incarnation) has recovered in its constructor
            wait_until_alive(self.trainer)
            try:
                info = call_when_alive(lambda: self.trainer.recovery.remote())
            except RayActorError as exc:
                return self._handle(Failure("trainer_gone", failure.step, str(exc).splitlines()[0]))
            if info["incarnation"] != self.incarnation:
                break
            time.sleep(0.02)
        self.incarnation = info["incarnation"]
        ended = time.perf_counter()
        seconds = ended - started
        self.recoveries.append(Recovery(failed_at_step=failure.step, mode=failure.mode, recovered_step=info["step"],
                                        seconds=seconds, image_source=info["source"],
                                        image_step=info.get("image_step"), replayed_records=info["replayed_records"],
                                        phases=_phases(started, [("restart", ended)], info, info)))
        self.say(f"  trainer lost at step {failure.step} ({failure.mode}); recovered at step {info['step']} from "
                 f"{info['source']} image in {seconds:.2f} s ({info['replayed_records']} records replayed)")
        self.step = info["step"]
        if info.get("state_hash"):
            self.step_hashes[self.step] = info["state_hash"]
        self.shadow_incarnation = self._metrics()["incarnation"]  # a host failure restarts the shadow too
        return State.RUNNING

    def _resync(self) -> State:
        packed = call_when_alive(lambda: self.trainer.export_state.remote())
        lost = self.failure is not None and self.failure.kind == "record_gap"  # don't wait for records nobody has
        call_when_alive(lambda: self.shadow.resync.remote(packed[:2], packed[2], 0.0 if lost else 60.0))
        ray.get(self.trainer.resynced.remote(packed[2]))
        self.resyncs.append((packed[2], self.resync_reason))
        metrics = self._metrics()
        self.lag_samples.append((self.step, metrics["lag_steps"]))
        self.say(f"  {self.resync_reason}: resynced from the trainer at step {packed[2]}")
        return State.RUNNING

    def _finish(self) -> State:
        job, task = self.job, self.task
        rank_hashes = ray.get([rank.state_hash.remote() for rank in self.ranks])
        final_step, final_hash = rank_hashes[0]
        try:
            metrics = call_when_alive(lambda: self.shadow.drain.remote(final_step, DRAIN_SECONDS))
        except RayTaskError as exc:
            return self._handle(Failure("drain_failed", final_step, f"the final state could not be made durable: "
                                        f"{str(exc.cause) if exc.cause else exc}"))
        _, shadow_hash = call_when_alive(lambda: self.shadow.replica_hash.remote())
        publisher = ray.get(self.trainer.publisher_stats.remote())
        evaluations = self.evaluations
        profile_check = self._profile_check(metrics)
        kernel = (self.last or {}).get("kernel") or {}
        if kernel.get("check") and kernel["check"].get("passed") is False:
            self._warn(f"the GPU kernels differed from the CPU oracle at start-up: the trainer ran the eager "
                       f"path ({kernel['check']})")
        self.summary = RunSummary(
            run_id=job.run_id, steps=final_step, final_state_hash=final_hash, shadow_state_hash=shadow_hash,
            losses=self.losses, recoveries=self.recoveries, metrics=metrics,
            publish_us_median=(self.last or {}).get("publish_us_median"),
            trainer_seconds_per_step=self.seconds_timed / max(self.steps_timed, 1),
            snapshot_interval=metrics["snapshot_interval"], profile=self.profile, storage=job.run_url,
            step_hashes=self.step_hashes, lag_samples=self.lag_samples, resumed_from_step=self.resumed_from,
            task=task.summary(), metric=task.metric, evaluations=dict(sorted(evaluations.items())),
            metric_before=evaluations[min(evaluations)][task.metric] if evaluations else None,
            metric_after=evaluations[final_step][task.metric] if final_step in evaluations else None,
            eval_seconds=self.eval_seconds, shadow_restarts=self.shadow_restarts,
            resent_records=publisher["resent_records"], resyncs=self.resyncs, warnings=self.warnings,
            states=self.states + [State.DONE.value], profile_check=profile_check, kernel=kernel,
            trainers=job.trainers,
            rank_state_hashes=[h for _, h in rank_hashes] if job.trainers > 1 else [],
            rank_seconds_per_step=[s / max(n, 1) for s, n in zip(self.rank_seconds, self.rank_steps)]
            if job.trainers > 1 else [],
            collective_seconds_per_step=self.collective_seconds / self.collective_steps
            if self.collective_steps else None,
        )
        return State.DONE

    # ------------------------------------------------------------------ helpers

    def _profile_check(self, metrics: dict) -> dict[str, dict[str, float]]:
        if self.profile is None:
            return {}
        timings = self.profile["timings"]
        pairs = {"trainer_step": (timings["gpu_step_seconds"], self.seconds_timed / max(self.steps_timed, 1)),
                 "replay_step": (timings["replay_step_seconds"], metrics["replay_seconds_per_step"])}
        out = {}
        for name, (profiled, steady) in pairs.items():
            if profiled > 0 and steady > 0:
                ratio = steady / profiled
                out[name] = {"profiled_seconds": profiled, "steady_seconds": steady, "ratio": ratio}
                if not 1 / PROFILE_TOLERANCE <= ratio <= PROFILE_TOLERANCE:
                    self._warn(f"the startup profile's {name.replace('_', ' ')} ({profiled * 1e3:.2f} ms) is "
                               f"{ratio:.2f}x off the run's steady state ({steady * 1e3:.2f} ms)")
        return out

    def _metrics(self) -> dict:
        try:
            report = ({"rank_seconds_per_step": self.recent_rank_seconds,
                       "collective_seconds_per_step": self.recent_collective} if self.recent_rank_seconds else None)
            return call_when_alive(lambda: self.shadow.metrics.remote(report))
        except ActorDiedError as exc:
            raise _Gone(Failure("shadow_gone", self.step, str(exc).splitlines()[0])) from exc

    def _absorb(self, p: dict) -> float:
        """Take a trainer progress report's hashes and evaluations; returns its evaluation seconds."""
        self.step_hashes.update(p.get("step_hashes") or {})
        self.evaluations.update(p.get("evaluations") or {})
        self.eval_seconds += p.get("eval_seconds", 0.0)
        return p.get("eval_seconds", 0.0)

    def _warn(self, message: str) -> None:
        self.warnings.append(f"step {self.step}: {message}")
        self.say(f"  warning: {message}")

    def _stop_actors(self) -> None:
        for actor in [*self.ranks, self.shadow]:
            if actor is None:
                continue
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        for group in self.groups:  # a given group (a Tune trial's) is not among them
            remove_placement_group(group)


class _Gone(Exception):
    """The shadow is gone for good: carries the failure to the state loop."""

    def __init__(self, failure: Failure):
        super().__init__(failure.detail)
        self.failure = failure


INJECTED = {
    "software": "the trainer process exits (Ray prints it as '(raylet) A worker died or was killed ...')",
    "host": "the trainer and the shadow lose their processes and in-memory images, as with a lost node",
    "shadow": "the shadow process is killed; Ray restarts it from durable storage",
}
PROFILE_TOLERANCE = 3.0
"""The startup profile's timings should agree with the run's steady state within this factor."""
DEFAULT_MAX_LAG_STEPS = 64
"""Resync bound when the job sets none and the startup profile gives none."""
DRAIN_SECONDS = 300.0
"""How long the end of a run waits for the shadow to replay and persist the final state."""


def _phases(started: float, marks: list[tuple[str, float]], constructed: dict | None, restored: dict) -> dict:
    """`Recovery.phases`: the seconds of each step of a recovery, in order, and the restarted
    process's constructor and restore (parts of `restart`, or of `rejoin` for a data-parallel rank)."""
    phases, last = {}, started
    for name, at in marks:
        phases[name], last = at - last, at
    if constructed and constructed.get("seconds") is not None:
        phases["constructor"] = constructed["seconds"]
    if restored.get("restore_seconds") is not None:
        phases["restore"] = restored["restore_seconds"]
    return phases


def run(job: JobConfig, fail_at: list[int] | None = None,
        fail_mode: Literal["software", "host", "shadow"] = "software",
        progress: Callable[[str], None] | None = print, kill_node: Callable[[], None] | None = None,
        placement_group: PlacementGroup | None = None, first_bundle: int = 0,
        on_segment: Callable[[dict, dict], None] | None = None, faults: FaultInjection | None = None,
        fail_rank: int = 0) -> RunSummary:
    """Run `job` to completion on the connected Ray cluster (a local one is started if none).

    A run whose storage already holds a snapshot of `job.run_id` resumes from it (the newest
    durable image plus the log, exactly). `placement_group`: an existing, reserved group (a Ray
    Tune trial's) whose bundles `first_bundle` (trainer) and `first_bundle + 1` (shadow) the
    actors use (and the next `trainers - 1` bundles, the other ranks); it is left in place.
    `on_segment(progress, metrics)` is called after each segment with the trainer's (rank 0's)
    progress and the shadow's metrics. `fail_at` / `fail_mode` /
    `faults` inject failures (tests, benchmarks, the demonstration): `software` kills the
    trainer process, `host` both processes, `shadow` the shadow process. With `trainers > 1`,
    `software` kills the process of rank `fail_rank`.
    Raises `JobConfigError` before any actor starts for a job that cannot run, and
    `RunFailedError` for a run that cannot go on.
    """
    say = progress or (lambda line: None)
    task = check_task(job)  # bad data, labels or a task/model mismatch fail here, before any actor starts
    try:  # an unusable storage URL fails here, before any actor starts
        open_storage(job.run_url, job.storage_options, create=True)
    except StorageError as exc:
        raise JobConfigError(f"storage={job.storage!r} cannot be used: {exc}") from exc
    if fail_mode not in ("software", "host", "shadow"):
        raise JobConfigError(f"fail_mode must be software, host or shadow, got {fail_mode!r}")
    if not 0 <= fail_rank < job.trainers:
        raise JobConfigError(f"fail_rank={fail_rank} is not a rank of trainers={job.trainers} (0..{job.trainers - 1})")
    if job.trainers > 1 and fail_at and fail_mode != "software":
        raise JobConfigError(f"fail_mode={fail_mode} with trainers={job.trainers}: only software failures (one "
                             "rank's process, --fail-rank) are injected into data-parallel runs")
    if not ray.is_initialized():
        connect_ray(say=progress, run_id=job.run_id)
    try:  # another live writer of this run's storage is refused, named; this cluster's dead shadow is not
        check_no_live_writer(job.run_url, job.storage_options)
    except LeaseHeldError as exc:
        if exc.holder is None or exc.holder.owner != shadow_writer(job.run_id):
            raise JobConfigError(f"storage={job.storage!r}: {exc}") from exc
    if placement_group is None:
        gpus = _check_resources(job)
    else:
        gpus = int(placement_group.bundle_specs[first_bundle].get("GPU", 0))
        if job.use_gpu == "yes" and gpus < 1:
            raise JobConfigError(f"use_gpu=yes but bundle {first_bundle} of the given placement group has no GPU")
        if len(placement_group.bundle_specs) < first_bundle + 1 + job.trainers:
            raise JobConfigError(f"trainers={job.trainers} need {job.trainers + 1} bundles from bundle {first_bundle} "
                                 f"of the given placement group (rank 0, the shadow, ranks 1..), which has "
                                 f"{len(placement_group.bundle_specs)}")
    failures = sorted(set(fail_at or []))
    if any(not 0 < f < job.steps for f in failures):
        raise JobConfigError(f"fail_at steps must lie in (0, {job.steps}), got {failures}")
    if job.snapshot_interval is None and failures:
        settings = profile_settings(job)
        profile_steps = max(settings.warmup_steps + settings.timed_steps, settings.replays_needed)
        if failures[0] <= profile_steps:
            raise JobConfigError(f"fail_at step {failures[0]} falls in the startup profile (its first "
                                 f"{profile_steps} steps); fail later or set snapshot_interval")
    return Controller(job, task, gpus, failures, fail_mode, say, kill_node, placement_group, first_bundle, on_segment,
                      faults or NO_FAULTS, fail_rank).run()
