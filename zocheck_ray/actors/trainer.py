"""The trainer: the unmodified ZO loop, publishing each step's record to the shadow.

`Trainer` is Ray-free; `TrainerActor` (ray_actors.py) wraps it. On construction it
recovers: it asks the shadow for its newest image and the records after it,
replays them on its own device and resumes at the next step; with no image, it
starts fresh and hands the shadow its initial state.

The batch of step t comes from the job's task (`task.batch(t)`, a pure function of
(task.data_seed, t)). Held-out evaluation runs every `task.eval_interval` steps, at
step 0 and at the last step, between steps on the unperturbed weights under
`no_grad`: it reads the state and never changes it, so the records and every
state_hash are those of a run without evaluation.

Data parallel (`job.trainers` = k > 1): this is rank `rank` of k identical replicas. It
evaluates its slice of each step's batch, the ranks all-gather their loss sums through
`LossGroup` (actors/collective.py) and every rank forms g from them in rank order, so the
replicas stay bit-identical. Rank 0 publishes the records; the others hold them until
they are durable. When a peer dies mid-step the gather fails: this rank stops with its
state torn (mid-perturbation), keeps its records, and is brought back to the common step
by `rejoin` (from the shadow's image plus records, like a restarted rank).
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
import torch

from zocheck_ray.actors.collective import LossGroup, RankLostError, reduce_in_rank_order
from zocheck_ray.actors.publisher import FLUSH_SECONDS, Publisher, ShadowLink
from zocheck_ray.config import JobConfig
from zocheck_ray.core import ZOOptimizer, replay, state_hash
from zocheck_ray.core.triton_kernels import replay_on_device
from zocheck_ray.core.fused import warm_up
from zocheck_ray.faults import NO_FAULTS, FaultInjection
from zocheck_ray.workload.data import step_seed
from zocheck_ray.workload.models import TORCH_DTYPES, build_model, trainable_parameters
from zocheck_ray.workload.tasks import build_task

logger = logging.getLogger(__name__)


class RejoinRequiredError(RuntimeError):
    """A data-parallel rank was asked to train before it rejoined (it was restarted, or its state is torn)."""


class Trainer:
    def __init__(self, job: JobConfig, shadow: ShadowLink, device: str = "cpu", faults: FaultInjection = NO_FAULTS,
                 rank: int = 0, defer_recovery: bool = False):
        """`defer_recovery`: a restarted data-parallel rank waits for `rejoin` (the survivors must first
        hand the shadow their records, so every rank recovers to the same step)."""
        self.job = job
        self.shadow = shadow
        self.faults = faults
        self.rank, self.ranks = rank, job.trainers
        self.group = LossGroup(rank, self.ranks) if self.ranks > 1 else None
        self.torn_at: int | None = None
        """The step a failed gather interrupted: the state is mid-perturbation until `rejoin`."""
        self._collective_seconds: list[float] = []
        self.device = torch.device(device)
        started = time.perf_counter()
        warm = None
        if self.device.type == "cpu":  # a recovery replays with the fused kernel: load it while the model builds
            warm = threading.Thread(target=warm_up, args=(TORCH_DTYPES[job.dtype], job.zo), name="zocheck-warm-up")
            warm.start()
        self.task = build_task(job.task, job.model)
        self.model = build_model(job.model, job.dtype, seed=job.run_seed).to(self.device)
        self.opt = ZOOptimizer(trainable_parameters(self.model), job.zo)
        if warm is not None:
            warm.join()
        self.publisher: Publisher | None = None
        if defer_recovery:
            self.recovery = {"step": None, "source": "deferred", "replayed_records": 0,
                             "seconds": time.perf_counter() - started}
        else:
            self._restore(started)
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

    @property
    def publish_ns(self) -> list[int]:
        """Nanoseconds each step's record took to publish on the training thread, in step order."""
        return self._publish_ns

    @property
    def step(self) -> int:
        return self.opt.step_index

    def _restore(self, started: float) -> None:
        restore_started = time.perf_counter()
        self.recovery, held = self._recover()
        self.recovery["restore_seconds"] = time.perf_counter() - restore_started  # image + records -> state
        self.recovery["seconds"] = time.perf_counter() - started
        # The records the shadow holds only in memory stay with the trainer until they are durable.
        self.publisher = Publisher(self.shadow, self.step, lambda: self.opt.step_index, held,
                                   publishing=self.rank == 0)
        self.torn_at = None

    def rejoin(self, step: int | None) -> dict:
        """Be a clean replica at `step` (None: whatever the shadow holds) after a lost rank; returns `recovery`.

        A rank whose state is torn, deferred or at another step recovers from the shadow's image
        plus records (which the survivors have completed); a clean rank at `step` stays as it is."""
        if self.publisher is None or self.torn_at is not None or step is None or self.step != step:
            self._restore(time.perf_counter())
        else:
            self.recovery = {"step": self.step, "source": "kept", "replayed_records": 0}
        if step is not None and self.step != step:
            raise RuntimeError(f"rank {self.rank} recovered to step {self.step}, not {step}: the shadow lacks records")
        return self.recovery

    def _recover(self) -> tuple[dict, list]:
        began = time.perf_counter()
        state, step, records, source = self.shadow.recovery_image()
        fetched = time.perf_counter()
        if state is None:
            if self.rank == 0:  # the other ranks build the same initial state from run_seed
                initial = {k: v.detach().to("cpu").clone() for k, v in self.opt.state_tensors().items()}
                self.shadow.initialize(initial, 0)
            return {"step": 0, "source": "fresh", "replayed_records": 0}, []
        self.opt.load_state_tensors({k: v.to(self.device) for k, v in state.items()}, step=step)
        marker = self.faults.crash_in_recovery_marker
        if marker and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)  # injected: die with the image loaded and its records not yet replayed
        loaded = time.perf_counter()
        if records:
            live = self.opt.state_tensors()
            if self.device.type == "cpu":
                replay(live, records, self.job.zo, start_step=step)
            else:  # the fused GPU kernels where they passed the start-up guard, else the eager oracle
                replay_on_device(live, records, self.job.zo, start_step=step, backend=self.opt.kernel_backend)
            self.opt.step_index = step + len(records)
        replayed = time.perf_counter()
        logger.info("trainer recovered at step %d from the %s image of step %d (+%d records)",
                    self.opt.step_index, source, step, len(records))
        digest = state_hash(self.opt.state_tensors()) if self.job.hash_every_step else None
        return {"step": self.opt.step_index, "source": source, "image_step": step, "replayed_records": len(records),
                "state_hash": digest, "fetch_seconds": fetched - began, "install_seconds": loaded - fetched,
                "replay_seconds": replayed - loaded, "hash_seconds": time.perf_counter() - replayed}, records

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

    def run(self, until_step: int, die_at_step: int | None = None, durable_next: int | None = None) -> dict:
        """Train up to `until_step` (exclusive); `die_at_step` kills the process there (failure injection).

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
        while self.step < until_step:
            t = self.step
            if die_at_step is not None and t == die_at_step:
                os._exit(1)  # an abrupt software failure: unsent records are lost
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

    def progress(self) -> dict:
        recent = self._publish_ns[-1000:]
        hashes, self.step_hashes = self.step_hashes, {}
        seconds, self._step_seconds = self._step_seconds, []
        evaluations, self._evaluations = self._evaluations, {}
        eval_seconds, self._eval_seconds = self._eval_seconds, 0.0
        collective, self._collective_seconds = self._collective_seconds, []
        return {"step": self.step, "loss": self.last_loss, "step_hashes": hashes, "step_seconds": seconds,
                "rank": self.rank, "collective_seconds": collective, "interrupted": self.torn_at,
                "evaluations": evaluations, "eval_seconds": eval_seconds,
                "publish_us_median": statistics.median(recent) / 1e3 if recent else None,
                "publisher": self.publisher.stats(), "kernel": self.kernel()}

    def kernel(self) -> dict:
        """Which implementation updates the weights (`fused`/`eager` on the CPU, `triton` or `eager` on CUDA)
        and, on CUDA, the start-up guard's verdict."""
        check = self.opt.kernel_check
        return {"device": self.device.type, "backend": self.opt.kernel_backend,
                "check": check.as_dict() if check is not None else None}

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

    def export_state(self) -> tuple[dict[str, torch.Tensor], int]:
        """A CPU copy of the state at the current step boundary (for a resync)."""
        self.publisher.flush()
        return {k: v.detach().to("cpu").clone() for k, v in self.opt.state_tensors().items()}, self.step

    def state_hash(self) -> tuple[int, str]:
        return self.step, state_hash(self.opt.state_tensors())

    def close(self) -> None:
        self._stop.set()
        self._flusher.join(timeout=5)
        if self.publisher is not None:
            self.publisher.flush()
        if self.group is not None:
            self.group.leave()
