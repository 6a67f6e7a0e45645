"""The trainer: the unmodified ZO loop, publishing each step's record to the shadow.

`Trainer` is Ray-free (`TrainerActor` wraps it). Its `Role` moves only along `TRANSITIONS`:

    WAITING -> RESTORING -> RANK -> TORN -> RESTORING -> RANK

A rank restores when built (`restore.py`); a standby or a restarted process waits for `rejoin`
(a CPU standby holding the newest image, `standby.py`); a rank whose gather fails is TORN,
mid-perturbation. Evaluation runs between steps on unperturbed weights: no record changes.
"""

from __future__ import annotations

import logging
import queue
import statistics
import threading
import time

import torch

from zocheck_ray.config import JobConfig
from zocheck_ray.core import ZOOptimizer, state_hash
from zocheck_ray.core.dtypes import JOB_DTYPES
from zocheck_ray.core.fused import warm_up
from zocheck_ray.host.image import prepare_skeleton
from zocheck_ray.runtime.parallel.collective import GroupAbandoned, LossGroup, RankLostError, open_rendezvous
from zocheck_ray.runtime.parallel.elastic import CALLS_PER_STEP, GroupPlan, PeerLost, catch_up, exchange_number, standing
from zocheck_ray.runtime.hooks import NO_HOOKS, TrainerHooks
from zocheck_ray.runtime.messages import AdapterIdentity, KernelCheckInfo, KernelInfo, RecoveryInfo, Role, TrainerProgress
from zocheck_ray.runtime.publisher import FLUSH_SECONDS, Publisher, ShadowLink
from zocheck_ray.runtime.restore import Restorer
from zocheck_ray.runtime.parallel.shards import ShardTable, assign, decode, encode, evaluate_shards, merge, \
    missing, reduce_in_shard_order, shard_count
from zocheck_ray.runtime.standby import Standby
from zocheck_ray.workload.adapters import build_trainable
from zocheck_ray.workload.builder import build_task
from zocheck_ray.workload.data import step_seed

logger = logging.getLogger(__name__)

TRANSITIONS: dict[Role, frozenset[Role]] = {
    Role.WAITING: frozenset({Role.RESTORING}),
    Role.RESTORING: frozenset({Role.RANK, Role.WAITING, Role.TORN}),  # restored, or failed (`_restore`)
    Role.RANK: frozenset({Role.RESTORING, Role.TORN}),
    Role.TORN: frozenset({Role.RESTORING}),
}


class RoleError(RuntimeError):
    """A move between roles that `TRANSITIONS` forbids."""


class RejoinRequiredError(RuntimeError):
    """Asked to train or hash before it rejoined (it waits, or its state is torn)."""


class Trainer:
    def __init__(self, job: JobConfig, shadow: ShadowLink, device: str = "cpu", hooks: TrainerHooks = NO_HOOKS,
                 rank: int = 0, waits: bool = False, incarnation: str = "", task=None):
        """`waits`: build a skeleton and wait for `rejoin`, so that every rank restores to one step. `task`: the
        job's task as the start-up check built it (None: built here)."""
        self.job = job
        self.shadow = shadow
        self.hooks = hooks
        self.incarnation = incarnation
        self.rank, self.ranks = rank, job.scaling.trainers
        self.shards = shard_count(job)
        self.held = assign(self.shards, self.ranks)[rank]
        """The shards this rank evaluates each step."""
        self.group = self._loss_group(rank, self.ranks)
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

        self.role = Role.WAITING
        self._collective_seconds: list[float] = []
        self._step_collective = 0.0
        self.device = torch.device(device)
        self.restorer = Restorer(job, shadow, self.device, hooks, incarnation)
        self.standby = Standby(job, shadow)
        started = time.perf_counter()
        warm = None
        if self.device.type == "cpu":  # a recovery replays with the fused kernel: load it while the model builds
            warm = threading.Thread(target=warm_up, args=(JOB_DTYPES[job.dtype], job.zo), name="zocheck-warm-up")
            warm.start()
        self.task = task if task is not None else build_task(job.task, job.model)
        # Asked first: with an image to recover from, the model's weights would only be overwritten.
        offer, fetch_seconds = (None, 0.0) if waits else self.restorer.borrow()
        self.model = self.opt = None
        if not (waits and self.device.type == "cuda"):  # a waiting GPU process allocates when it is told to go
            self._build(skeleton=waits or offer is not None, prefault=waits)
        self.build_seconds = time.perf_counter() - started
        if warm is not None:
            warm.join()
        self.publisher: Publisher | None = None
        if waits:
            self.recovery = RecoveryInfo(incarnation=incarnation, step=None, source="deferred", role=self.role,
                                         seconds=time.perf_counter() - started, build_seconds=self.build_seconds)
        else:
            self._restore(started, offer, fetch_seconds, may_start_fresh=True)
        self._publish_ns: list[int] = []
        self.step_hashes: dict[int, str] = {}
        self._step_seconds: list[float] = []
        self.last_loss: float | None = None
        self._evaluations: dict[int, dict[str, float]] = {}
        self._samples: dict[int, list[tuple[str, str]]] = {}
        self._eval_seconds = 0.0
        self._evaluated: set[int] = set()
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="zocheck-publish", daemon=True)
        self._flusher.start()

    def _become(self, role: Role) -> None:
        if role not in TRANSITIONS[self.role]:
            raise RoleError(f"rank {self.rank} cannot go from {self.role.value} to {role.value}")
        self.role = role

    def _build(self, skeleton: bool, prefault: bool = False) -> None:
        """The model, or a `skeleton` an image fills (`prefault`: pages touched now, so a restore is a plain
        copy). An adapter's frozen base always gets its weights."""
        built = build_trainable(self.job.model, self.job.dtype, self.job.run_seed, self.job.peft,
                                device=self.device, weights="none" if skeleton else "load")
        self.model = built.model
        self.adapter = None if built.base_hash is None else AdapterIdentity(
            base_hash=built.base_hash, adapter_config=built.adapter_config)
        """An adapter run's base hash and adapter config, as built here."""
        self.opt = ZOOptimizer(built.parameters, self.job.zo)
        if prefault:
            with torch.no_grad():
                prepare_skeleton(self.opt.state_tensors())

    @property
    def publish_ns(self) -> list[int]:
        """Each step's publish cost on the training thread (ns)."""
        return self._publish_ns

    @property
    def step(self) -> int:
        return self.opt.step_index if self.opt is not None else 0

    # ------------------------------------------------------------------ restoring

    def _restore(self, started: float, offer=None, fetch_seconds: float | None = None,
                 may_start_fresh: bool = False) -> None:
        """Restore from `offer`, or from a new one where none was fetched (`Restorer.restore`)."""
        came_from = self.role
        self._become(Role.RESTORING)
        try:
            if self.model is None:
                self._build(skeleton=True)
            if fetch_seconds is None:
                offer, fetch_seconds = self.restorer.borrow(held=self.standby.token)
            preinstalled = offer is not None and self.standby.take(offer)
            info, held = self.restorer.restore(self.opt, self.adapter, offer, self.rank, may_start_fresh,
                                               preinstalled)
        except BaseException:
            # A skeleton still holds nothing; any other state may be half-written.
            self._become(Role.WAITING if came_from is Role.WAITING else Role.TORN)
            raise
        self._become(Role.RANK)
        parts = (fetch_seconds, info.install_seconds, info.replay_seconds, info.hash_seconds)
        self.recovery = info.model_copy(update={
            "role": self.role, "fetch_seconds": fetch_seconds, "restore_seconds": sum(p or 0.0 for p in parts),
            "seconds": time.perf_counter() - started, "build_seconds": self.build_seconds})
        # The records the shadow holds only in memory stay with the trainer until they are durable.
        self.publisher = Publisher(self.shadow, self.step, lambda: self.opt.step_index, held,
                                   publishing=self.rank == 0)

    def rejoin(self, step: int | None, rank: int | None = None, ranks: int | None = None) -> RecoveryInfo:
        """Be rank `rank` of `ranks` (None: as now) at `step` (None: the shadow's); returns `recovery`. Only a
        RANK at `step` keeps its state."""
        rank = self.rank if rank is None else rank
        ranks = self.ranks if ranks is None else ranks
        if (rank, ranks) != (self.rank, self.ranks) or self.group is None and ranks > 1:
            self.rank, self.ranks = rank, ranks
            self.held = assign(self.shards, ranks)[rank]
            self.group = self._loss_group(rank, ranks)
        if self.role is not Role.RANK or step is None or self.step != step:
            self._restore(time.perf_counter(), may_start_fresh=self.role is Role.RANK)
        else:
            self.recovery = RecoveryInfo(incarnation=self.incarnation, step=self.step, source="kept", role=self.role)
        if step is not None and self.step != step:
            raise RuntimeError(f"rank {self.rank} recovered to step {self.step}, not {step}: the shadow lacks records")
        return self.recovery

    @property
    def holds_images(self) -> bool:
        """Whether `preinstall` copies images in: a built CPU process that waits."""
        return self.role is Role.WAITING and self.model is not None and self.device.type == "cpu"

    @property
    def held_image(self) -> tuple[str, int] | None:
        """The (token, step) of the image the waiting state holds; None: none."""
        return self.standby.held

    def preinstall(self) -> int | None:
        """Where `holds_images`, copy the newest image in (`Standby.preinstall`); None elsewhere: a GPU
        standby allocates only when promoted."""
        return self.standby.preinstall(self.opt, self.adapter) if self.holds_images else None

    # ------------------------------------------------------------------ training

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the current state, recorded under its step."""
        began = time.perf_counter()
        metrics = self.task.evaluate(self.model)
        if hasattr(self.task, "samples"):  # kind `sft`: greedy generations from held-out prompts
            self._samples[self.step] = self.task.samples(self.model)
        self._eval_seconds += time.perf_counter() - began
        self._evaluations[self.step] = metrics
        self._evaluated.add(self.step)
        return metrics

    def _due_for_evaluation(self) -> bool:
        if self.rank != 0:  # the replicas are identical: rank 0's held-out metrics are every rank's
            return False
        step = self.step
        return step % self.job.task.eval_interval == 0 or step == self.job.steps

    def _require_rank(self, doing: str) -> None:
        if self.role is not Role.RANK:
            at = f" at step {self.step}" if self.role is Role.TORN else ""
            raise RejoinRequiredError(f"rank {self.rank} is {self.role.value}{at}: it must rejoin before it {doing}")

    def run(self, until_step: int, durable_next: int | None = None) -> TrainerProgress:
        """Train up to `until_step` (exclusive); records before `durable_next` are durable. A failed gather
        leaves the rank TORN and is reported (`interrupted`), not raised."""
        self._require_rank("trains")
        if durable_next is not None:
            self.publisher.acknowledge(durable_next)
        model = self.model
        if self.step < until_step and self._due_for_evaluation() and self.step not in self._evaluated:
            self.evaluate()  # step 0 (the metric before training), or a step a recovery resumed at
        # Bound once: after a step has evicted the caches, every object the append reaches is a miss.
        publish, clock, publish_ns = self.publisher.append, time.perf_counter_ns, self._publish_ns
        before_step = self.hooks.before_step if self.hooks.steps_hooked else None
        while self.step < until_step:
            t = self.step
            if before_step is not None:
                before_step(self.rank, t)
            began = time.perf_counter()
            if self.shards == 1:
                record = self.opt.step(self.task.closure(model, t), seed=step_seed(self.job.run_seed, t))
            else:
                self._step_collective, self._calls = 0.0, 0
                try:
                    record = self.opt.step(self._shard_closure(model, t), seed=step_seed(self.job.run_seed, t),
                                           combine=reduce_in_shard_order)
                except RankLostError as exc:
                    logger.warning("%s: stopping at step %d until the group is re-formed", exc, t)
                    self._become(Role.TORN)
                    self.group.leave()
                    break
                if self.group is not None:
                    self._collective_seconds.append(self._step_collective)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self._step_seconds.append(time.perf_counter() - began)
            start = clock()
            publish(record)  # the whole critical-path cost of publishing
            publish_ns.append(clock() - start)
            self.last_loss = self.opt.last_losses[0]
            if self.job.hash_every_step:
                self.step_hashes[self.step] = state_hash(self.opt.state_tensors())
            if self._due_for_evaluation():
                self.evaluate()
        self.publisher.flush()
        return self.progress()

    def _shard_closure(self, model, t: int):
        """Step `t`'s closure: every shard's table, this rank's evaluated here, the others' exchanged."""
        closures: dict = {}

        def closure_of(shard: int):
            if shard not in closures:  # the shard's rows, collated once per step
                closures[shard] = self.task.slice_closure(model, t, shard, self.shards)
            return closures[shard]

        def table() -> ShardTable:
            mine = evaluate_shards(closure_of, self.held, self.shards)
            return mine if self.group is None else self._exchange(t, mine, closure_of)
        return table

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

    def reform(self, generation: int) -> int:
        """At a step boundary, join group `generation` unless an exchange did."""
        if self.generation < generation:
            self._regroup(exchange_number(self.step, 0), inside=False, generation=generation)
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
            self.publisher.take_over()  # rank 0 sends the records; the shadow gets those the lost one had not
        logger.info("rank %d of %d from group %d (%s), shards %s", rank, plan.ranks, plan.generation, plan.cause,
                    list(self.held))

    def _loss_group(self, rank: int, ranks: int) -> LossGroup | None:
        return LossGroup(rank, ranks, self.job.scaling.collective_timeout_seconds) if ranks > 1 else None

    def join_group(self, address: str, port: int) -> float:
        """Join the ranks' group at rank 0's address:port; returns the seconds."""
        return self.group.join(address, port)

    def progress(self) -> TrainerProgress:
        """The segment since the last report: steps, hashes, evaluations, timings."""
        recent = self._publish_ns[-1000:]
        hashes, self.step_hashes = self.step_hashes, {}
        seconds, self._step_seconds = self._step_seconds, []
        evaluations, self._evaluations = self._evaluations, {}
        samples, self._samples = self._samples, {}
        eval_seconds, self._eval_seconds = self._eval_seconds, 0.0
        collective, self._collective_seconds = self._collective_seconds, []
        regroups, self._regroups = self._regroups, []
        return TrainerProgress(step=self.step, loss=self.last_loss, rank=self.rank, step_hashes=hashes,
                               step_seconds=seconds, collective_seconds=collective,
                               interrupted=self.step if self.role is Role.TORN else None, regroups=regroups,
                               evaluations=evaluations, samples=samples, eval_seconds=eval_seconds,
                               publish_us_median=statistics.median(recent) / 1e3 if recent else None,
                               publisher=self.publisher.stats(), kernel=self.kernel())

    def kernel(self) -> KernelInfo:
        """The weights' update kernel and, on CUDA, the start-up guard's verdict."""
        check = self.opt.kernel_check
        return KernelInfo(device=self.device.type, backend=self.opt.kernel_backend,
                          check=KernelCheckInfo(**check.as_dict()) if check is not None else None)

    # ------------------------------------------------------------------ the shadow

    def _flush_loop(self) -> None:
        # Off the training loop's critical path: encode and send, take replies, re-send what a
        # restarted shadow lacks.
        while not self._stop.wait(FLUSH_SECONDS):
            publisher = self.publisher  # replaced by a rejoin
            if publisher is None:
                continue
            try:
                publisher.tick()
            except Exception:  # never end the publishing thread: the next tick tries again
                logger.exception("publishing failed")

    def deliver(self) -> int:
        """Hand the shadow the records it lacks; returns the step it then expects."""
        return self.publisher.deliver() if self.publisher is not None else 0

    def export_to_shadow(self) -> int:
        """A resync: the state into the shadow's intake; returns its step."""
        self.publisher.flush()
        self.shadow.write_state(self.opt.state_tensors())
        return self.step

    def state_hash(self) -> tuple[int, str]:
        self._require_rank("hashes its state")  # a waiting or torn state is nobody's
        return self.step, state_hash(self.opt.state_tensors())

    def close(self, hand_over: bool = True) -> None:
        """Stop publishing; `hand_over=False` drops unsent records, as a dying process does."""
        self._stop.set()
        self._flusher.join(timeout=5)
        if self.publisher is not None and hand_over:
            self.publisher.flush()
        if self.group is not None:
            self.group.leave()
