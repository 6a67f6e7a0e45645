"""The startup profile: the first training steps measure what the cost model needs, and set N."""

from __future__ import annotations

from typing import Callable

from zocheck_ray.config import JobConfig
from zocheck_ray.policies import FailureModel, ProfileReport, ProfileSettings, profile_startup
from zocheck_ray.runtime.messages import TrainerProgress

DRAIN_SECONDS = 300.0
"""Seconds a drain waits for the shadow to replay and persist."""


def profile_settings(job: JobConfig, remaining_steps: int | None = None) -> ProfileSettings:
    return ProfileSettings(thread_counts=tuple(range(1, job.shadow.cpus + 1)), warmup_steps=2, timed_steps=5,
                           replay_repeats=2, max_training_steps=min(30, job.steps if remaining_steps is None
                                                                   else remaining_steps))


def profile_steps(job: JobConfig) -> int:
    """The training steps the startup profile takes."""
    settings = profile_settings(job)
    return max(settings.warmup_steps + settings.timed_steps, settings.replays_needed)


def startup_profile(job: JobConfig, shadow, train_to: Callable[[int], TrainerProgress],
                    first_step: int = 0) -> ProfileReport:
    """Measure the costs of the cost model in the first training steps and choose N and the replay threads;
    `train_to(step)` trains every rank to `step`."""
    settings = profile_settings(job, job.steps - first_step)
    reached = [first_step]

    def trainer_step(i: int) -> float:
        progress = train_to(first_step + i + 1)
        reached[0] = progress.step
        return progress.step_seconds[-1] if progress.step_seconds else 0.0

    def replay_step(i: int, threads: int) -> float:
        seconds = shadow.profile_replay(threads)
        return seconds if seconds is not None else 0.0

    def persist() -> float:
        seconds = shadow.last_persist_seconds()
        if seconds is None:  # a resumed run's shadow has written nothing yet
            shadow.drain(reached[0], DRAIN_SECONDS)
            seconds = shadow.last_persist_seconds()
        return seconds

    report = profile_startup(trainer_step=trainer_step, replay_step=replay_step,
                             snapshot_copy=shadow.profile_snapshot,
                             persist=persist, settings=settings, storage_share=job.durability.storage_share,
                             failures=None if job.failure.mtbf_hours is None else
                             FailureModel(mtbf_hours=job.failure.mtbf_hours))
    shadow.end_profile(report.replay_threads, report.snapshot_interval, report.plan.regime,
                       report.plan.durable_interval)
    return report
