"""The startup profile: measure the cost model's inputs in the first training steps, set N.

Ray-free: the controller passes callables wrapping remote calls (`trainer_step(i)`,
`replay_step(i, threads)`, `snapshot_copy()`, `persist()`), tests plain functions. Each is timed
with `clock` unless it returns its own seconds (CUDA-synchronised in the actor); the thread count
with the fastest median wins.

    >>> import time
    >>> report = profile_startup(
    ...     trainer_step=lambda i: 8.65, replay_step=lambda i, p: 6.59 * 2 / min(p, 2),
    ...     snapshot_copy=lambda: 4.0, persist=lambda: 20.0,
    ...     settings=ProfileSettings(thread_counts=(1, 2)))
    >>> report.replay_threads, report.snapshot_interval
    (2, 4)
"""

from __future__ import annotations

import math
import numbers
import statistics
import time
from collections.abc import Callable, Mapping

from pydantic import BaseModel, ConfigDict, field_validator

from zocheck_ray.policies.cost_model import DEFAULT_STORAGE_SHARE, FailureModel, PolicyInputError, Timings
from zocheck_ray.policies.planner import Plan, plan

MAX_PROFILE_STEPS = 30


class ProfileSettings(BaseModel):
    """How much to measure; the defaults fit in 30 training steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    thread_counts: tuple[int, ...] = (1, 2, 4, 8)
    """Replay thread counts to try (each >= 1, no repeats)."""
    warmup_steps: int = 2
    """First trainer steps left out of the timing."""
    timed_steps: int = 5
    """Trainer steps timed at least."""
    replay_repeats: int = 2
    """Timed replays per thread count, after one untimed."""
    snapshot_repeats: int = 2
    """Timed snapshot copies."""
    persist_repeats: int = 1
    """Timed snapshot writes (one in flight at a time)."""
    max_training_steps: int = MAX_PROFILE_STEPS
    """The profile must finish within this many trainer steps."""

    @field_validator("thread_counts")
    @classmethod
    def _threads(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value:
            raise ValueError("thread_counts must list at least one thread count")
        if any(p < 1 for p in value) or len(set(value)) != len(value):
            raise ValueError(f"thread_counts must be distinct integers >= 1, got {value!r}")
        return value

    @field_validator("timed_steps", "replay_repeats", "snapshot_repeats", "persist_repeats", "max_training_steps")
    @classmethod
    def _at_least_one(cls, value: int, info) -> int:
        if value < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {value!r}")
        return value

    @field_validator("warmup_steps")
    @classmethod
    def _warmup(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {value!r}")
        return value

    @property
    def replays_needed(self) -> int:
        return len(self.thread_counts) * (1 + self.replay_repeats)


class KnownTimings(BaseModel):
    """Numbers measured elsewhere; each one given skips its measurement."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_step_seconds: float | None = None
    """T_gpu, e.g. from the trainer's own step timer."""
    replay_step_seconds: float | None = None
    """T_rep at `replay_threads` (both or neither)."""
    replay_threads: int | None = None
    """The thread count `replay_step_seconds` was measured with."""
    snapshot_cost_seconds: float | None = None
    """C_snap."""
    persist_seconds: float | None = None
    """T_per."""

    @field_validator("gpu_step_seconds", "replay_step_seconds", "snapshot_cost_seconds", "persist_seconds")
    @classmethod
    def _positive(cls, value: float | None, info) -> float | None:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{info.field_name} must be a positive, finite number of seconds, got {value!r}")
        return value

    @field_validator("replay_threads")
    @classmethod
    def _threads(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"replay_threads must be >= 1, got {value!r}")
        return value


class ProfileReport(BaseModel):
    """What the startup profile measured and chose."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    training_steps: int
    """Trainer steps run by the profile."""
    gpu_step_samples: list[float]
    """Timed trainer steps, seconds (empty when known)."""
    replay_seconds_by_threads: dict[int, float]
    """Median replay time per record for each thread count tried."""
    snapshot_samples: list[float]
    """Timed snapshot copies, seconds."""
    persist_samples: list[float]
    """Timed snapshot writes, seconds."""
    measured: list[str]
    """Which Timings fields were measured here (the rest were known)."""
    replay_threads: int
    """The chosen replay thread count (the fastest)."""
    timings: Timings
    """The cost-model inputs, as measured and given."""
    plan: Plan
    """The policy's plan for those inputs."""
    snapshot_interval: int
    """N, as in `plan`."""
    profile_seconds: float
    """Wall-clock time the profile took."""


def _timed(name: str, call: Callable[[], object], clock: Callable[[], float]) -> float:
    """Run `call`: the seconds it returns, else the time `clock` saw pass."""
    start = clock()
    result = call()
    elapsed = clock() - start
    if result is None:
        return elapsed
    if isinstance(result, bool) or not isinstance(result, numbers.Real):
        raise PolicyInputError(name, f"must return None or its duration in seconds, got {result!r}")
    seconds = float(result)
    if not (math.isfinite(seconds) and seconds > 0):
        raise PolicyInputError(name, f"reported a duration of {seconds!r} s; it must be positive and finite")
    return seconds


def _require(name: str, call: Callable | None) -> Callable:
    if call is None:
        raise PolicyInputError(name, f"give `{name}` to measure it, or its value in `known`")
    return call


def profile_startup(
    *,
    trainer_step: Callable[[int], object] | None = None,
    replay_step: Callable[[int, int], object] | None = None,
    snapshot_copy: Callable[[], object] | None = None,
    persist: Callable[[], object] | None = None,
    known: KnownTimings | None = None,
    settings: ProfileSettings | None = None,
    failures: FailureModel | None = None,
    extra_timings: Mapping[str, float | None] | None = None,
    lag_bound_steps: float | None = None,
    storage_share: float = DEFAULT_STORAGE_SHARE,
    clock: Callable[[], float] = time.perf_counter,
) -> ProfileReport:
    """Measure what is not `known`, pick the fastest thread count, and plan N (and the resync bound, given
    `failures`). Raises `PolicyInputError` naming the callable or setting at fault."""
    known = known or KnownTimings()
    settings = settings or ProfileSettings()
    if (known.replay_step_seconds is None) != (known.replay_threads is None):
        raise PolicyInputError("known.replay_threads", "give replay_step_seconds and replay_threads together")
    started = clock()
    steps_needed = _training_steps_needed(known, settings)
    measured: list[str] = []
    gpu_samples = _time_training(trainer_step, steps_needed, known, settings, clock)
    gpu_step = known.gpu_step_seconds
    if known.gpu_step_seconds is None:
        gpu_step = statistics.median(gpu_samples)
        measured.append("gpu_step_seconds")
    by_threads: dict[int, float] = {}
    if known.replay_step_seconds is None:
        by_threads = _scan_replay(_require("replay_step", replay_step), settings, clock)
        threads = min(by_threads, key=lambda p: (by_threads[p], p))
        replay_seconds = by_threads[threads]
        measured.append("replay_step_seconds")
    else:
        threads, replay_seconds = known.replay_threads, known.replay_step_seconds
    snapshot_samples = _samples("snapshot_copy", snapshot_copy, known.snapshot_cost_seconds,
                                settings.snapshot_repeats, clock, measured, "snapshot_cost_seconds")
    persist_samples = _samples("persist", persist, known.persist_seconds, settings.persist_repeats, clock,
                               measured, "persist_seconds")
    timings = Timings(
        gpu_step_seconds=gpu_step, replay_step_seconds=replay_seconds,
        snapshot_cost_seconds=statistics.median(snapshot_samples) if snapshot_samples else known.snapshot_cost_seconds,
        persist_seconds=statistics.median(persist_samples) if persist_samples else known.persist_seconds,
        **dict(extra_timings or {}),
    )
    chosen = plan(timings, failures, lag_bound_steps=lag_bound_steps, replay_threads=threads,
                  storage_share=storage_share)
    return ProfileReport(
        training_steps=steps_needed, gpu_step_samples=gpu_samples, replay_seconds_by_threads=by_threads,
        snapshot_samples=snapshot_samples, persist_samples=persist_samples, measured=measured,
        replay_threads=threads, timings=timings, plan=chosen, snapshot_interval=chosen.snapshot_interval,
        profile_seconds=clock() - started,
    )


def _training_steps_needed(known: KnownTimings, settings: ProfileSettings) -> int:
    """Training steps the profile runs: the timed GPU steps, and the records the replay scan consumes."""
    needed = max(settings.warmup_steps + settings.timed_steps if known.gpu_step_seconds is None else 0,
                 settings.replays_needed if known.replay_step_seconds is None else 0)
    if needed > settings.max_training_steps:
        raise PolicyInputError(
            "thread_counts",
            f"{settings.warmup_steps} warm-up + {settings.timed_steps} timed steps and "
            f"{len(settings.thread_counts)} thread counts x {1 + settings.replay_repeats} replays need "
            f"{needed} training steps, more than max_training_steps={settings.max_training_steps}; "
            "try fewer thread_counts or replay_repeats",
        )
    return needed


def _time_training(trainer_step, steps: int, known: KnownTimings, settings: ProfileSettings, clock) -> list[float]:
    """Run `steps` training steps; the timed ones after warm-up, when the GPU step is not known."""
    samples: list[float] = []
    if steps:
        step = _require("trainer_step", trainer_step)
        for i in range(steps):
            seconds = _timed("trainer_step", lambda: step(i), clock)
            if known.gpu_step_seconds is None and i >= settings.warmup_steps:
                samples.append(seconds)
    return samples


def _scan_replay(replay, settings: ProfileSettings, clock) -> dict[int, float]:
    """Median replay seconds per thread count, each after one untimed replay."""
    by_threads: dict[int, float] = {}
    record = 0
    for threads in settings.thread_counts:
        samples = []
        for repeat in range(1 + settings.replay_repeats):
            seconds = _timed("replay_step", lambda: replay(record, threads), clock)
            record += 1
            if repeat:
                samples.append(seconds)
        by_threads[threads] = statistics.median(samples)
    return by_threads


def _samples(name: str, fn, known: float | None, repeats: int, clock, measured: list[str], field: str) -> list[float]:
    """`repeats` timings of `fn` where its figure is not known (none where it is)."""
    if known is not None:
        return []
    call = _require(name, fn)
    measured.append(field)
    return [_timed(name, call, clock) for _ in range(repeats)]
