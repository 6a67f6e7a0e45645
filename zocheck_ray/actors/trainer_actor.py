"""`TrainerActor`, the trainer's Ray actor. The module imports only Ray and the standard library: the
process Ray restarts beside a standby's promotion defers torch and its model until `prepare`, so it
takes no cores from the promotion (its constructor's arguments must not import torch either).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import uuid
from typing import TYPE_CHECKING, Literal

import ray

from zocheck_ray.actors.names import is_ours

if TYPE_CHECKING:
    from zocheck_ray.runtime.messages import KernelInfo, PublisherStats, RecoveryInfo, TrainerProgress
    from zocheck_ray.runtime.trainer import Trainer

Prepared = Literal["constructor", "prepare", "first use"]


RECOVERY_THREADS = 8
"""A trainer's numba threads, or one per core where more (`size_numba_pool`): the replay uses them all to keep its
share of the cores beside a recovery's neighbours."""


def size_numba_pool() -> None:
    """`NUMBA_NUM_THREADS` = max(`RECOVERY_THREADS`, this process's CPUs), unless set or numba is loaded."""
    if "numba" in sys.modules or os.environ.get("NUMBA_NUM_THREADS"):
        return
    from zocheck_ray.core.cpus import process_cpus  # the standard library only: the core's names load on first use

    os.environ["NUMBA_NUM_THREADS"] = str(max(RECOVERY_THREADS, process_cpus()))


def _input_error() -> type:
    """The run's input error (data, function or model), kept for a restarted process's first call, which meets it
    again."""
    from zocheck_ray.workload.errors import WorkloadError

    return WorkloadError


def _inputs(name: str | None):
    """The task held under `name`, its `model_init` made this process's model of its name first."""
    if name is None:
        return None
    from zocheck_ray.actors.inputs import take_inputs

    task, model_init = take_inputs(name)
    if model_init is not None:
        from zocheck_ray.workload.model_init import register

        register(model_init)
    return task


FOLLOW_WAIT_SECONDS = 2.0
"""One wait of `TrainerActor.follow` for the shadow's next image (a promotion ends it within this)."""


@ray.remote(concurrency_groups={"standby": 1, "regroup": 1, "report": 1})
class TrainerActor:
    """One `Trainer`, a rank or the standby. Methods run in order on one thread; `follow`, `open_group`,
    `offer_plan` and `peer_lost` each on its own, so a promotion or a new group need not wait for a blocked
    `run`."""

    def __init__(self, job: dict, hooks=None, rank: int = 0, standby: bool = False, inputs: str | None = None):
        """`inputs`: the run's `InputsActor`, whose task the trainer takes (None: it builds the job's task)."""
        size_numba_pool()  # before anything imports numba in this process
        logging.basicConfig(level=logging.INFO)
        self.incarnation = uuid.uuid4().hex  # tells a restarted trainer from the one before
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._args = (job, hooks, rank, standby or restarted, inputs)
        self._created_as_standby = standby
        self._trainer: Trainer | None = None
        self.prepared_by: Prepared | None = None  # which call built the trainer
        self._state = threading.Lock()  # held while `follow` copies or `rejoin` restores
        self._rejoined = threading.Event()  # ends a `follow`
        self._refusal: Exception | None = None
        if not (restarted and job.get("failure", {}).get("standby")):
            try:
                self._prepare("constructor")
            except Exception as exc:
                if not (is_ours(exc) and (not (restarted or standby) or isinstance(exc, _input_error()))):
                    raise
                # Ray prints a constructor's error with its traceback, above the run's one line: a rank's first
                # start raises it from its first call instead (a restart or a standby only the run's input error;
                # any other still ends as Ray reports)
                self._refusal = exc

    def _prepare(self, by: Prepared) -> None:
        if self._refusal is not None:
            raise self._refusal
        if self._trainer is not None:
            return
        from zocheck_ray.host.heap import settling_heap

        with settling_heap():  # the imports and the model's build: no cyclic collector passes over them
            self._build(by)

    def _build(self, by: Prepared) -> None:
        import torch

        from zocheck_ray.runtime.hooks import NO_HOOKS
        from zocheck_ray.host.image import transfer_threads
        from zocheck_ray.actors.link import RayShadowLink
        from zocheck_ray.runtime.trainer import Trainer
        from zocheck_ray.config import JobConfig

        job, hooks, rank, waits, inputs = self._args
        (hooks or NO_HOOKS).before_build(self._created_as_standby)
        job = JobConfig.model_validate(job)
        device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
        # k ranks on a node share its cores: each uses the CPUs it reserved. A sharded run does so with one rank
        # too, as a forward pass's bits may depend on its threads.
        if job.scaling.trainers > 1 or job.task.shards not in (None, 1):
            import numba

            cpus = max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
            numba.set_num_threads(min(cpus, numba.config.NUMBA_NUM_THREADS))
            torch.set_num_threads(cpus)
        self._trainer = Trainer(job, RayShadowLink(job.run_id, threads=transfer_threads()), device=device,
                                hooks=hooks or NO_HOOKS, rank=rank, waits=waits, incarnation=self.incarnation,
                                task=_inputs(inputs))
        self.prepared_by = by

    @property
    def trainer(self) -> Trainer:
        self._prepare("first use")
        return self._trainer

    @ray.method(max_task_retries=-1)  # sent while Ray restarts the process, it waits for the new one
    def prepare(self) -> Prepared:
        """Build the trainer if not built yet; returns which call built it."""
        self._prepare("prepare")
        return self.prepared_by

    @ray.method(max_task_retries=-1)
    def readiness(self) -> Prepared | None:
        """Which call built the trainer; None: not yet."""
        return self.prepared_by

    def pid(self) -> int:
        return os.getpid()

    @ray.method(max_task_retries=-1)  # a query: sent while Ray restarts the actor, it waits for the new one
    def recovery(self) -> RecoveryInfo:
        return self.trainer.recovery

    def run(self, until_step: int, durable_next: int | None = None) -> TrainerProgress:
        return self.trainer.run(until_step, durable_next)

    def group_address(self, loopback: bool = False) -> tuple[str, int]:
        """Rank 0: open the ranks' rendezvous here (127.0.0.1 with `loopback`); returns address and port."""
        address = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        return address, self.trainer.ranks.group.listen(address)

    def join_group(self, address: str, port: int) -> float:
        return self.trainer.ranks.join_group(address, port)

    @ray.method(concurrency_group="regroup")
    def open_group(self, loopback: bool, ranks: int, generation: int) -> tuple[str, int]:
        """As rank 0 of the planned group `generation`: open its rendezvous; returns address and port."""
        address = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        return address, self._trainer.ranks.open_group(address, ranks, generation)

    @ray.method(concurrency_group="regroup")
    def offer_plan(self, rank: int, plan) -> None:
        self._trainer.ranks.offer_plan(rank, plan)

    @ray.method(concurrency_group="report")
    def peer_lost(self):
        """Waits for this rank's next failed exchange; returns its `PeerLost` report (None: not built)."""
        return self._trainer.ranks.next_loss() if self._trainer is not None else None

    def reform(self, generation: int) -> int:
        """At a step boundary, after `run`: join group `generation` unless an exchange already did."""
        return self.trainer.ranks.reform(generation, self.trainer.step)

    def deliver(self) -> int:
        return self.trainer.deliver()

    def rejoin(self, step: int | None, rank: int | None = None, ranks: int | None = None) -> RecoveryInfo:
        self._rejoined.set()
        with self._state:  # a copy of `follow`'s in progress ends first (the image it copies may be the one offered)
            return self.trainer.rejoin(step, rank, ranks)

    def preinstall(self) -> int | None:
        """The standby: copy the shadow's newest image in now (`Trainer.preinstall`)."""
        with self._state:
            return self._trainer.preinstall() if self._trainer is not None else None

    @ray.method(concurrency_group="standby")
    def follow(self) -> None:
        """The CPU standby: copy in each new image of the shadow's until `rejoin`, so a promotion replays only
        the records after the newest; ends at once where nothing is held."""
        trainer, offered = self._trainer, None
        while trainer is not None:
            with self._state:
                if self._rejoined.is_set() or not trainer.holds_images:
                    return
                trainer.preinstall()
                held = trainer.standby.token
            if held is None and offered is not None:
                return  # an image was offered that cannot be held (one without a name): nothing to follow
            try:  # the next image (the wait is the shadow's: no CPU here), or the end of the wait
                offered = trainer.shadow.newer_image(held, FOLLOW_WAIT_SECONDS)
            except ray.exceptions.RayError:  # the shadow is lost or restarting: the controller asks again later
                return

    @ray.method(max_task_retries=-1)
    def held_image(self) -> int | None:
        """The step of the image the standby holds; None: none."""
        held = self._trainer.held_image if self._trainer is not None else None
        return held[1] if held is not None else None

    def export_to_shadow(self) -> int:
        """A resync: the state into the shadow's intake; returns its step."""
        return self.trainer.export_to_shadow()

    def resynced(self, step: int) -> None:
        self.trainer.publisher.clear_gap(step)

    def state_hash(self) -> tuple[int, str]:
        return self.trainer.state_hash()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def publisher_stats(self) -> PublisherStats:
        return self.trainer.publisher.stats()

    def kernel(self) -> KernelInfo:
        """Which implementation updates the weights (see `Trainer.kernel`)."""
        return self.trainer.kernel()
