"""The trainer: the unmodified ZO loop, publishing each step's record to the shadow.

`Trainer` is Ray-free; `TrainerActor` (trainer_actor.py) wraps it. A trainer process has a
role. As a rank it recovers on construction: it asks the shadow for its newest image and
the records after it, builds its model as a skeleton (parameters allocated, neither
initialised nor loaded: the image overwrites every one), copies the image into it,
replays the records on its own device and resumes at the next step; with no image, it
builds the model with its weights, starts fresh and hands the shadow its initial state.
Restarted by Ray, or started as the run's warm standby, it builds the skeleton and waits:
the controller tells it which rank to be and at which step (`rejoin`), and it restores
then. On the CPU a standby also touches its skeleton's pages, and copies each new image of
the shadow's into them while it waits (`preinstall`): a promotion offered that image only
replays the records after it.

The batch of step t comes from the job's task (`task.batch(t)`, a pure function of
(task.data_seed, t)). Held-out evaluation runs every `task.eval_interval` steps, at
step 0 and at the last step, between steps on the unperturbed weights under
`no_grad`: it reads the state and never changes it, so the records and every
state_hash are those of a run without evaluation.

Data parallel (`job.trainers` = k > 1): this is rank `rank` of k identical replicas. It
evaluates its slice of each step's batch, the ranks all-gather their loss sums through
`LossGroup` (runtime/collective.py) and every rank forms g from them in rank order, so the
replicas stay bit-identical. Rank 0 publishes the records; the others hold them until
they are durable. When a peer dies mid-step the gather fails: this rank stops with its
state torn (mid-perturbation), keeps its records, and is brought back to the common step
by `rejoin` (from the shadow's image plus records, like a restarted rank).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time

import torch

from zocheck_ray.runtime.collective import LossGroup, RankLostError, reduce_in_rank_order
from zocheck_ray.runtime.hooks import NO_HOOKS, TrainerHooks
from zocheck_ray.host.image import prepare_skeleton
from zocheck_ray.runtime.messages import AdapterIdentity, KernelCheckInfo, KernelInfo, RecoveryInfo, TrainerProgress
from zocheck_ray.runtime.publisher import FLUSH_SECONDS, Publisher, ShadowLink
from zocheck_ray.config import JobConfig
from zocheck_ray.core import ZOOptimizer, replay, state_hash
from zocheck_ray.core.errors import StateMismatchError
from zocheck_ray.core.fused import default_threads, warm_up
from zocheck_ray.core.triton_kernels import replay_on_device
from zocheck_ray.workload.data import step_seed
from zocheck_ray.workload.adapters import BaseModelMismatchError, build_trainable
from zocheck_ray.core.dtypes import JOB_DTYPES
from zocheck_ray.workload.models import model_config_dict
from zocheck_ray.workload.builder import build_task

logger = logging.getLogger(__name__)


def check_base(job: JobConfig, mine: AdapterIdentity | None, recorded: AdapterIdentity | None) -> None:
    """Refuse to put a run's adapter on another base model than the one it was trained on."""
    if mine is None or (recorded is not None and recorded.base_hash == mine.base_hash):
        return
    was = f"SHA-256 {recorded.base_hash}" if recorded is not None else "not recorded (the image is not of an adapter run)"
    raise BaseModelMismatchError(
        f"the base model {job.model!r} this trainer built has weights SHA-256 {mine.base_hash}, but the run "
        f"{job.run_id!r} trained its adapter on a base whose weights hash {was}: recovering would put the "
        "adapter on another model. Restore the model directory (or model, dtype and run_seed) the run started "
        "with, or start a new run_id")


class RejoinRequiredError(RuntimeError):
    """A data-parallel rank was asked to train before it rejoined (it was restarted, or its state is torn)."""


class Trainer:
    def __init__(self, job: JobConfig, shadow: ShadowLink, device: str = "cpu", hooks: TrainerHooks = NO_HOOKS,
                 rank: int = 0, waits: bool = False, incarnation: str = ""):
        """`waits`: restarted by Ray, or the run's standby: build the skeleton and wait for `rejoin` (a
        data-parallel run's survivors must first hand the shadow their records, so every rank restores
        to the same step)."""
        self.job = job
        self.shadow = shadow
        self.hooks = hooks
        self.incarnation = incarnation
        self.rank, self.ranks = rank, job.trainers
        self.group = LossGroup(rank, self.ranks) if self.ranks > 1 else None
        self.torn_at: int | None = None
        """The step a failed gather interrupted: the state is mid-perturbation until `rejoin`."""
        self._collective_seconds: list[float] = []
        self.device = torch.device(device)
        started = time.perf_counter()
        warm = None
        if self.device.type == "cpu":  # a recovery replays with the fused kernel: load it while the model builds
            warm = threading.Thread(target=warm_up, args=(JOB_DTYPES[job.dtype], job.zo), name="zocheck-warm-up")
            warm.start()
        self.task = build_task(job.task, job.model)
        # Asked first: with an image to recover from, the model's weights would only be overwritten.
        asked = time.perf_counter()
        offer = None if waits else self.shadow.borrow_image(fresh=self._fresh_offer)
        self._fetch_seconds = time.perf_counter() - asked
        self.model = self.opt = None
        self._skeleton = waits or offer is not None
        """The parameters hold nothing until an image is copied into them."""
        self._preinstalled: str | None = None
        """The token of the shadow's image the waiting state holds (`preinstall`), None: none."""
        self._held_step: int | None = None
        """... and that image's step."""
        if not (waits and self.device.type == "cuda"):  # a waiting GPU process allocates when it is told to go
            self._build(prefault=waits)
        self.build_seconds = time.perf_counter() - started
        if warm is not None:
            warm.join()
        self.publisher: Publisher | None = None
        if waits:
            self.recovery = RecoveryInfo(incarnation=incarnation, step=None, source="deferred", role="waiting",
                                         seconds=time.perf_counter() - started, build_seconds=self.build_seconds)
        else:
            self._restore(started, offer, asked=True)
        self._publish_ns: list[int] = []
        self.step_hashes: dict[int, str] = {}
        self._step_seconds: list[float] = []
        self.last_loss: float | None = None
        self._evaluations: dict[int, dict[str, float]] = {}
        self._eval_seconds = 0.0
        self._evaluated: set[int] = set()
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="zocheck-publish", daemon=True)
        self._flusher.start()

    def _build(self, prefault: bool = False) -> None:
        """The model: its weights, or a skeleton when an image will fill it (`prefault`: touch its pages
        now, so that a later restore is a plain copy). With an adapter (`job.peft`) the frozen base is
        always built with its weights (from the model directory or the seed): only the adapter's
        parameters come from an image."""
        built = build_trainable(self.job.model, self.job.dtype, self.job.run_seed, self.job.peft,
                                device=self.device, weights="none" if self._skeleton else "load")
        self.model = built.model
        self.adapter = None if built.base_hash is None else AdapterIdentity(
            base_hash=built.base_hash, adapter_config=built.adapter_config)
        """A parameter-efficient run's base (its hash) and adapter, as this trainer built them."""
        self.opt = ZOOptimizer(built.parameters, self.job.zo)
        if prefault:
            with torch.no_grad():
                prepare_skeleton(self.opt.state_tensors())

    @property
    def _fresh_offer(self) -> bool:
        """Whether a recovery asks the shadow for a snapshot of its replica (`JobConfig.recovery_snapshot`): on
        the CPU, where replaying a record costs several copies of the state; a GPU replays on the device."""
        return self.job.recovery_snapshot and self.device.type == "cpu"

    @property
    def publish_ns(self) -> list[int]:
        """Nanoseconds each step's record took to publish on the training thread, in step order."""
        return self._publish_ns

    @property
    def step(self) -> int:
        return self.opt.step_index if self.opt is not None else 0

    def _restore(self, started: float, offer=None, asked: bool = False) -> None:
        """Recover (from `offer`, or from what the shadow offers now unless it was `asked` already)."""
        if self.model is None:
            self._build()
        if not asked:
            began = time.perf_counter()
            offer = self.shadow.borrow_image(fresh=self._fresh_offer, held=self._preinstalled)
            self._fetch_seconds = time.perf_counter() - began
        info, held = self._recover(offer)
        parts = (self._fetch_seconds, info.install_seconds, info.replay_seconds, info.hash_seconds)
        self.recovery = info.model_copy(update={
            "fetch_seconds": self._fetch_seconds, "restore_seconds": sum(p or 0.0 for p in parts),
            "seconds": time.perf_counter() - started, "build_seconds": self.build_seconds})
        # The records the shadow holds only in memory stay with the trainer until they are durable.
        self.publisher = Publisher(self.shadow, self.step, lambda: self.opt.step_index, held,
                                   publishing=self.rank == 0)
        self.torn_at = None

    @property
    def holds_images(self) -> bool:
        """Whether `preinstall` copies images in: a waiting process (no rank yet) on the CPU, built."""
        return self.publisher is None and self.model is not None and self.device.type == "cpu"

    @property
    def held_image(self) -> tuple[str, int] | None:
        """The token and step of the shadow's image the waiting state holds (`preinstall`); None: none."""
        return (self._preinstalled, self._held_step) if self._preinstalled is not None else None

    def preinstall(self) -> int | None:
        """While this process waits (the standby) on the CPU: copy the shadow's newest image into the skeleton
        now, unless it holds that image already, so that a promotion offered the same image only replays the
        records after it. Returns the step of the image it holds (None: nothing to hold; a GPU standby, which
        allocates its device memory only when promoted, and a process serving a rank hold nothing)."""
        if not self.holds_images:
            return None
        offer = self.shadow.borrow_image()
        if offer is None:
            return None
        try:
            if offer.token is None:  # an image without a name (an in-process shadow's): nothing to recognise later
                return None
            if offer.token != self._preinstalled:
                self._preinstalled = None  # torn until the copy is done
                check_base(self.job, self.adapter, getattr(offer, "adapter", None))
                offer.copy_into(self.opt.state_tensors())
                self._preinstalled, self._held_step = offer.token, offer.step
            return offer.step
        finally:
            offer.release()

    def rejoin(self, step: int | None, rank: int | None = None) -> RecoveryInfo:
        """Be a clean replica of rank `rank` (None: this one's) at `step` (None: whatever the shadow holds);
        returns `recovery`.

        A process that waited (restarted, or the standby promoted), a rank whose state is torn, or one
        at another step recovers from the shadow's image plus records (which the survivors have
        completed); a clean rank at `step` stays as it is."""
        if rank is not None and rank != self.rank:
            self.rank = rank
            self.group = LossGroup(rank, self.ranks) if self.ranks > 1 else None
        if self.publisher is None or self.torn_at is not None or step is None or self.step != step:
            self._restore(time.perf_counter())
        else:
            self.recovery = RecoveryInfo(incarnation=self.incarnation, step=self.step, source="kept")
        if step is not None and self.step != step:
            raise RuntimeError(f"rank {self.rank} recovered to step {self.step}, not {step}: the shadow lacks records")
        return self.recovery

    def _recover(self, offer) -> tuple[RecoveryInfo, list]:
        began = time.perf_counter()
        if offer is None:
            if self._skeleton or self.torn_at is not None or self.opt.step_index > 0:
                raise RuntimeError(f"rank {self.rank} must restore its state from the shadow, which holds no image "
                                   "(a shadow that was never initialized, or lost its image)")
            if self.rank == 0:  # the other ranks build the same initial state from run_seed
                if self.adapter is None:  # the config the snapshots carry: transformers is loaded here already
                    self.shadow.initialize(self.opt.state_tensors(), 0, model_config=model_config_dict(self.job.model))
                else:
                    self.shadow.initialize(self.opt.state_tensors(), 0, adapter=self.adapter)
            return RecoveryInfo(incarnation=self.incarnation, step=0, source="fresh"), []
        step, records, source = offer.step, offer.records, offer.source
        preinstalled = self._preinstalled is not None and offer.token == self._preinstalled
        self._preinstalled = None  # the state moves on from here
        copy_seconds = None
        try:
            check_base(self.job, self.adapter, getattr(offer, "adapter", None))
            if not preinstalled:
                tensors = self.opt.state_tensors()
                copy_began = time.perf_counter()
                offer.copy_into(tensors)
                copy_seconds = time.perf_counter() - copy_began
        except BaseModelMismatchError:
            raise
        except ValueError as exc:  # the image is of another model or optimizer
            raise StateMismatchError(f"the shadow's image of step {step} does not fit this trainer: {exc}") from exc
        finally:
            offer.release()
        self._skeleton = False
        self.opt.step_index = step
        self.hooks.after_restore()
        loaded = time.perf_counter()
        replay_threads = None
        if records:
            live = self.opt.state_tensors()
            if self.device.type == "cpu":
                # on numba's whole pool: in a trainer process, more threads than cores (trainer_actor.py)
                replay_threads = default_threads()
                replay(live, records, self.job.zo, start_step=step, threads=replay_threads)
            else:  # the fused GPU kernels where they passed the start-up guard, else the eager oracle
                replay_on_device(live, records, self.job.zo, start_step=step, backend=self.opt.kernel_backend)
            self.opt.step_index = step + len(records)
        replayed = time.perf_counter()
        logger.info("trainer recovered at step %d from the %s image of step %d (+%d records)",
                    self.opt.step_index, source, step, len(records))
        digest = state_hash(self.opt.state_tensors()) if self.job.hash_every_step else None
        return RecoveryInfo(incarnation=self.incarnation, step=self.opt.step_index, source=source, image_step=step,
                            replayed_records=len(records), state_hash=digest, state_bytes=offer.layout.state_bytes,
                            preinstalled=preinstalled, copy_seconds=copy_seconds,
                            copy_threads=offer.threads if copy_seconds is not None else None,
                            install_seconds=loaded - began, replay_seconds=replayed - loaded,
                            replay_threads=replay_threads, hash_seconds=time.perf_counter() - replayed), records

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the current state (recorded under the current step)."""
        began = time.perf_counter()
        metrics = self.task.evaluate(self.model)
        self._eval_seconds += time.perf_counter() - began
        self._evaluations[self.step] = metrics
        self._evaluated.add(self.step)
        return metrics

    def _due_for_evaluation(self) -> bool:
        if self.rank != 0:  # the replicas are identical: rank 0's held-out metrics are every rank's
            return False
        step = self.step
        return step % self.job.task.eval_interval == 0 or step == self.job.steps

    def run(self, until_step: int, durable_next: int | None = None) -> TrainerProgress:
        """Train up to `until_step` (exclusive).

        `durable_next`: every record before it is durable (a holding rank drops them). A data-parallel
        rank whose gather fails stops there and reports `interrupted` instead of raising."""
        if self.torn_at is not None or self.publisher is None:
            raise RejoinRequiredError(f"rank {self.rank} must rejoin before it trains (its state is torn at step "
                               f"{self.torn_at})" if self.torn_at is not None else
                               f"rank {self.rank} has not recovered yet (it waits for rejoin)")
        if durable_next is not None:
            self.publisher.acknowledge(durable_next)
        model = self.model
        if self.step < until_step and self._due_for_evaluation() and self.step not in self._evaluated:
            self.evaluate()  # step 0 (the metric before training), or a step a recovery resumed at
        # Bound once: after a step has evicted the caches, every object the append reaches is a
        # cache miss (`self.publisher.append` cost about twice the deque append alone).
        publish, clock, publish_ns = self.publisher.append, time.perf_counter_ns, self._publish_ns
        before_step = self.hooks.before_step if self.hooks.steps_hooked else None
        while self.step < until_step:
            t = self.step
            if before_step is not None:
                before_step(self.rank, t)
            began = time.perf_counter()
            if self.group is None:
                record = self.opt.step(self.task.closure(model, t), seed=step_seed(self.job.run_seed, t))
            else:
                closure = self.task.slice_closure(model, t, self.rank, self.ranks)
                try:
                    record = self.opt.step(closure, seed=step_seed(self.job.run_seed, t), combine=self._combine)
                except RankLostError as exc:
                    logger.warning("%s: stopping at step %d until the group is re-formed", exc, t)
                    self.torn_at = t
                    self.group.leave()
                    break
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

    def _combine(self, plus: tuple[float, float], minus: tuple[float, float]) -> tuple[float, float]:
        began = time.perf_counter()
        gathered = self.group.gather((*plus, *minus))
        self._collective_seconds.append(time.perf_counter() - began)
        return reduce_in_rank_order(gathered)

    def join_group(self, address: str, port: int) -> float:
        """Join the ranks' process group (rank 0 opened address:port); returns the seconds it took."""
        return self.group.join(address, port)

    def deliver(self) -> int:
        """Hand the shadow every record it lacks (after a lost rank); returns the step it then expects."""
        return self.publisher.deliver() if self.publisher is not None else 0

    def progress(self) -> TrainerProgress:
        """What happened since the last report (the segment's steps, hashes, evaluations, timings)."""
        recent = self._publish_ns[-1000:]
        hashes, self.step_hashes = self.step_hashes, {}
        seconds, self._step_seconds = self._step_seconds, []
        evaluations, self._evaluations = self._evaluations, {}
        eval_seconds, self._eval_seconds = self._eval_seconds, 0.0
        collective, self._collective_seconds = self._collective_seconds, []
        return TrainerProgress(step=self.step, loss=self.last_loss, rank=self.rank, step_hashes=hashes,
                               step_seconds=seconds, collective_seconds=collective, interrupted=self.torn_at,
                               evaluations=evaluations, eval_seconds=eval_seconds,
                               publish_us_median=statistics.median(recent) / 1e3 if recent else None,
                               publisher=self.publisher.stats(), kernel=self.kernel())

    def kernel(self) -> KernelInfo:
        """Which implementation updates the weights (`fused`/`eager` on the CPU, `triton` or `eager` on CUDA)
        and, on CUDA, the start-up guard's verdict."""
        check = self.opt.kernel_check
        return KernelInfo(device=self.device.type, backend=self.opt.kernel_backend,
                          check=KernelCheckInfo(**check.as_dict()) if check is not None else None)

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

    def export_to_shadow(self) -> int:
        """Write the state at the current step boundary into the shadow's intake (a resync); returns the step."""
        self.publisher.flush()
        self.shadow.write_state(self.opt.state_tensors())
        return self.step

    def state_hash(self) -> tuple[int, str]:
        if self.publisher is None or self.torn_at is not None:  # a waiting or torn state is nobody's
            raise RejoinRequiredError(f"rank {self.rank} holds no state to hash until it rejoins")
        return self.step, state_hash(self.opt.state_tensors())

    def close(self, hand_over: bool = True) -> None:
        """Stop publishing. `hand_over`: send the shadow the records not sent yet; False stops as a dying
        process does, those records lost (an in-process software failure, `testing.in_process`)."""
        self._stop.set()
        self._flusher.join(timeout=5)
        if self.publisher is not None and hand_over:
            self.publisher.flush()
        if self.group is not None:
            self.group.leave()
