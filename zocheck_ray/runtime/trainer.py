"""The trainer: the unmodified ZO loop, publishing each step's record to the shadow.

`Trainer` is Ray-free (`TrainerActor` wraps it). Its `Role` moves only along `TRANSITIONS`:

    WAITING -> RESTORING -> RANK -> TORN -> RESTORING -> RANK

A rank restores when built; a standby or a restarted process waits for `rejoin`; a rank whose
gather fails mid-perturbation is TORN. Evaluation runs between steps on unperturbed weights, so
no record changes.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from zocheck_ray.config import JobConfig
from zocheck_ray.core import ZOOptimizer, state_hash
from zocheck_ray.core.dtypes import JOB_DTYPES
from zocheck_ray.core.fused import warm_up
from zocheck_ray.host.image import prepare_skeleton
from zocheck_ray.runtime.parallel.collective import RankLostError
from zocheck_ray.runtime.parallel.shards import reduce_in_shard_order
from zocheck_ray.runtime.errors import RejoinRequiredError, RoleError
from zocheck_ray.runtime.hooks import NO_HOOKS, TrainerHooks
from zocheck_ray.runtime.messages import AdapterIdentity, KernelCheckInfo, KernelInfo, RecoveryInfo, Role, TrainerProgress
from zocheck_ray.runtime.publisher import FLUSH_SECONDS, Publisher, ShadowLink
from zocheck_ray.runtime.rank_group import RankGroup
from zocheck_ray.runtime.restore import Restorer
from zocheck_ray.runtime.segment import SegmentLog
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


class Trainer:
    def __init__(self, job: JobConfig, shadow: ShadowLink, device: str = "cpu", hooks: TrainerHooks = NO_HOOKS,
                 rank: int = 0, waits: bool = False, incarnation: str = "", task=None):
        """`waits`: build a skeleton and wait for `rejoin`, so that every rank restores to one step; `task`: the
        start-up check's (None: built here)."""
        self.job, self.shadow, self.hooks, self.incarnation = job, shadow, hooks, incarnation
        self.ranks = RankGroup(job, rank, hooks, take_over=lambda: self.publisher.take_over())
        self.log = SegmentLog()
        self.role = Role.WAITING
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
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="zocheck-publish", daemon=True)
        self._flusher.start()

    def _become(self, role: Role) -> None:
        if role not in TRANSITIONS[self.role]:
            raise RoleError(f"rank {self.ranks.rank} cannot go from {self.role.value} to {role.value}")
        self.role = role

    def _build(self, skeleton: bool, prefault: bool = False) -> None:
        """The model, or a `skeleton` an image fills (`prefault`: pages touched now, so a restore is a plain
        copy). An adapter's frozen base always gets its weights."""
        built = build_trainable(self.job.model, self.job.dtype, self.job.run_seed, self.job.peft,
                                device=self.device, weights="none" if skeleton else "load",
                                quantization=self.job.quantization)
        self.model = built.model
        self.adapter = None if built.base_hash is None else AdapterIdentity(
            base_hash=built.base_hash, adapter_config=built.adapter_config)
        """An adapter run's base hash and adapter config, as built here."""
        self.opt = ZOOptimizer(built.parameters, self.job.zo)
        if prefault:
            with torch.no_grad():
                prepare_skeleton(self.opt.state_tensors())

    @property
    def rank(self) -> int:
        return self.ranks.rank

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
            info, held = self.restorer.restore(self.opt, self.adapter, offer, self.ranks.rank, may_start_fresh,
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
                                   publishing=self.ranks.rank == 0)

    def rejoin(self, step: int | None, rank: int | None = None, ranks: int | None = None) -> RecoveryInfo:
        """Be rank `rank` of `ranks` (None: as now) at `step` (None: the shadow's); returns `recovery`. Only a
        RANK at `step` keeps its state."""
        self.ranks.place(self.ranks.rank if rank is None else rank, self.ranks.ranks if ranks is None else ranks)
        if self.role is not Role.RANK or step is None or self.step != step:
            self._restore(time.perf_counter(), may_start_fresh=self.role is Role.RANK)
        else:
            self.recovery = RecoveryInfo(incarnation=self.incarnation, step=self.step, source="kept", role=self.role)
        if step is not None and self.step != step:
            raise RuntimeError(f"rank {self.ranks.rank} recovered to step {self.step}, not {step}: the shadow lacks "
                               "records")
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
        # kind `sft`: greedy generations from held-out prompts
        samples = self.task.samples(self.model) if hasattr(self.task, "samples") else None
        self.log.evaluation(self.step, metrics, samples, time.perf_counter() - began)
        return metrics

    def _due_for_evaluation(self) -> bool:
        if self.ranks.rank != 0:  # the replicas are identical: rank 0's held-out metrics are every rank's
            return False
        step = self.step
        return step % self.job.task.eval_interval == 0 or step == self.job.steps

    def _require_rank(self, doing: str) -> None:
        if self.role is not Role.RANK:
            at = f" at step {self.step}" if self.role is Role.TORN else ""
            raise RejoinRequiredError(f"rank {self.ranks.rank} is {self.role.value}{at}: it must rejoin before it "
                                      f"{doing}")

    def run(self, until_step: int, durable_next: int | None = None) -> TrainerProgress:
        """Train up to `until_step` (exclusive); records before `durable_next` are durable. A failed gather
        leaves the rank TORN and is reported (`interrupted`), not raised."""
        self._require_rank("trains")
        if durable_next is not None:
            self.publisher.acknowledge(durable_next)
        model = self.model
        if self.step < until_step and self._due_for_evaluation() and self.step not in self.log.evaluated:
            self.evaluate()  # step 0 (the metric before training), or a step a recovery resumed at
        # Bound once: after a step has evicted the caches, every object the append reaches is a miss.
        publish, clock, log, ranks = self.publisher.append, time.perf_counter_ns, self.log, self.ranks
        before_step = self.hooks.before_step if self.hooks.steps_hooked else None
        while self.step < until_step:
            t = self.step
            if before_step is not None:
                before_step(ranks.rank, t)
            began = time.perf_counter()
            if ranks.shards == 1:
                record = self.opt.step(self.task.closure(model, t), seed=step_seed(self.job.run_seed, t))
            else:
                try:
                    record = self.opt.step(ranks.closure(self.task, model, t), seed=step_seed(self.job.run_seed, t),
                                           combine=reduce_in_shard_order)
                except RankLostError as exc:
                    logger.warning("%s: stopping at step %d until the group is re-formed", exc, t)
                    self._become(Role.TORN)
                    ranks.leave()
                    break
                ranks.stepped()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - began
            start = clock()
            publish(record)  # the whole critical-path cost of publishing
            log.stepped(seconds, clock() - start, self.opt.last_losses[0])
            if self.job.hash_every_step:
                log.step_hashes[self.step] = state_hash(self.opt.state_tensors())
            if self._due_for_evaluation():
                self.evaluate()
        self.publisher.flush()
        return self.progress()

    def progress(self) -> TrainerProgress:
        """The segment since the last report: steps, hashes, evaluations, timings."""
        collective, regroups = self.ranks.times()
        return TrainerProgress(step=self.step, rank=self.ranks.rank, collective_seconds=collective,
                               interrupted=self.step if self.role is Role.TORN else None, regroups=regroups,
                               publisher=self.publisher.stats(), kernel=self.kernel(), **self.log.take())

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
        self.ranks.leave()
