"""A job's trainer and shadow in this process, through software and host failures, without Ray.

    result = run_in_process(job, software=[3, 6, 9], host=[11])

The same `Trainer` and `Shadow` a Ray run puts in two processes, joined by `InProcessLink`, so a test
takes every optimizer x adapter x dtype through every recovery path in seconds. A software failure drops
the trainer before a step; a host failure also stops the shadow, which rebuilds from durable storage.
Every step's state hash is kept, to compare with `uninterrupted_hashes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zocheck_ray.runtime.hooks import NO_HOOKS
from zocheck_ray.runtime.messages import RecoveryInfo, ShadowMetrics, TrainerProgress
from zocheck_ray.runtime.publisher import StateOffer, poll_answered
from zocheck_ray.runtime.shadow import Shadow
from zocheck_ray.runtime.trainer import Trainer
from zocheck_ray.config import JobConfig


class InjectedDeath(RuntimeError):
    """The trainer died before running a step (an injected software failure, in process)."""


class DieBefore:
    """`TrainerHooks`: raise `InjectedDeath` before each of `steps`, once each, so a restarted trainer handed the
    same hooks trains the step."""

    steps_hooked = True

    def __init__(self, steps):
        self.pending = set(steps)

    def before_step(self, rank: int, step: int) -> None:
        if step in self.pending:
            self.pending.discard(step)
            raise InjectedDeath(f"injected software failure before step {step}")

    def after_restore(self) -> None:
        pass


class InProcessLink:
    """`ShadowLink` over a `Shadow` in this process; pushes are answered at once. The lent image is copied on
    the shadow's replay thread, the only one that replaces images, so no snapshot can free it mid-copy."""

    def __init__(self, shadow: Shadow):
        self.shadow = shadow

    def borrow_image(self, fresh: bool = False, held: str | None = None):
        """The newest image and the records after it (`fresh` and `held` are ignored: recoveries here always
        replay the records)."""
        return self.shadow.replay.call(self._copy_of_image)

    def _copy_of_image(self) -> StateOffer | None:
        image, records = self.shadow.recovery_view()
        if image is None:
            return None
        source = "durable" if self.shadow.replay.source == "durable" else "memory"
        state = {name: tensor.clone() for name, tensor in image.tensors().items()}
        return StateOffer(state, image.step, records, source, adapter=self.shadow.adapter)

    def initialize(self, state, step, adapter=None, model_config=None):
        self.shadow.initialize(step, state, adapter=adapter, model_config=model_config)

    def write_state(self, state):
        raise NotImplementedError("an in-process run takes no resync (keep shadow.max_lag_steps above the run's steps)")

    def push(self, data, trainer_step=None):
        return self.shadow.push(data, trainer_step)

    poll = staticmethod(poll_answered)


@dataclass
class InProcessRun:
    """What `run_in_process` saw."""

    step_hashes: dict[int, list[str]] = field(default_factory=dict)
    """Every state hash a trainer reported after each step (a step trained again appears more than once)."""
    recoveries: list[RecoveryInfo] = field(default_factory=list)
    """Each replacement trainer's recovery (source `memory` after a software failure, `durable` after a host
    failure), in order."""
    evaluations: dict[int, dict[str, float]] = field(default_factory=dict)
    final_hash: str | None = None
    shadow: tuple[int, str] | None = None
    """The shadow's replica (step, state hash) after the last step was drained."""
    metrics: ShadowMetrics | None = None
    """The last shadow's metrics after the drain."""

    def absorb(self, progress: TrainerProgress) -> None:
        for step, digest in progress.step_hashes.items():
            self.step_hashes.setdefault(step, []).append(digest)
        self.evaluations.update(progress.evaluations)

    def note_dev(self, job: JobConfig, shadow: Shadow) -> None:
        """With dev rows: the dev losses so far to the shadow, as the controller tells them."""
        if job.task.num_dev is not None and self.evaluations:
            shadow.note_dev({s: m["dev_loss"] for s, m in self.evaluations.items() if "dev_loss" in m},
                            max(self.evaluations))


def run_in_process(job: JobConfig, software=(), host=(), drain_timeout: float = 120.0,
                   first_shadow_hooks=NO_HOOKS) -> InProcessRun:
    """Train `job` to its last step with software failures before the steps `software` and host failures after
    the steps `host`."""
    hooks, pending_host = DieBefore(software), sorted(host)
    result = InProcessRun()
    shadow = Shadow(job, hooks=first_shadow_hooks)
    trainer = Trainer(job, InProcessLink(shadow), hooks=hooks)
    try:
        while trainer.step < job.steps:
            target = min(trainer.step + job.log_interval, job.steps, *[h for h in pending_host if h > trainer.step])
            try:
                result.absorb(trainer.run(target))
            except InjectedDeath:
                result.absorb(trainer.progress())
                trainer = _replace(trainer, job, shadow, hooks, result)
                continue
            result.note_dev(job, shadow)
            if pending_host and trainer.step == pending_host[0]:
                pending_host.pop(0)
                trainer.close(hand_over=False)
                shadow.close()
                shadow = Shadow(job)  # rebuilt from durable storage
                result.note_dev(job, shadow)  # told again, as the controller tells a restarted shadow
                trainer = _replace(None, job, shadow, hooks, result)
        result.final_hash = trainer.state_hash()[1]
        trainer.close()
        result.metrics = shadow.drain(job.steps, timeout=drain_timeout)
        result.shadow = shadow.replica_hash()
        return result
    finally:
        trainer.close()
        shadow.close()


def _replace(dead: Trainer | None, job: JobConfig, shadow: Shadow, hooks: DieBefore,
             result: InProcessRun) -> Trainer:
    if dead is not None:
        dead.close(hand_over=False)
    trainer = Trainer(job, InProcessLink(shadow), hooks=hooks)
    result.recoveries.append(trainer.recovery)
    return trainer


__all__ = ["DieBefore", "InProcessLink", "InProcessRun", "InjectedDeath", "run_in_process"]
