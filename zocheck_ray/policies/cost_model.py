"""The ZOCheck cost model: how many replayed steps between snapshots, and when to resync.

Symbols (DESIGN.md section 5) are those of the `Timings` fields; N is the snapshot interval, M the MTBF in
seconds.

    pacing       T_rep + C_snap / N <= T_gpu   ->  N >= C_snap / (T_gpu - T_rep)   (T_rep < T_gpu)
    persistence  N * T_rep >= T_per            ->  N >= T_per / T_rep

Keep-pace (T_rep < T_gpu): N* = max(1, ceil(pacing), ceil(persistence)), whatever M. Lag: N and the
resync bound L are Young-Daly square roots, solved together. `waste.py` has the expected waste.

    >>> t = Timings(gpu_step_seconds=8.65, replay_step_seconds=6.59,
    ...             snapshot_cost_seconds=4.0, persist_seconds=20.0)
    >>> regime(t), keep_pace_interval(t)
    ('keep-pace', 4)
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from zocheck_ray.core.errors import ZOCheckError

Regime = Literal["keep-pace", "lag"]
FailureKind = Literal["software", "host"]

SECONDS_PER_HOUR = 3600.0


class PolicyInputError(ZOCheckError, ValueError):
    """Inputs valid one by one but not together (an MTBF shorter than a step)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


_REQUIRED_TIMES = ("gpu_step_seconds", "replay_step_seconds", "snapshot_cost_seconds", "persist_seconds")
_OPTIONAL_TIMES = (
    "restart_seconds", "load_seconds", "storage_read_seconds", "recovery_replay_step_seconds",
    "log_step_seconds", "state_copy_seconds", "checkpoint_save_seconds",
)


class Timings(BaseModel):
    """Measured (or assumed) costs, in seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_step_seconds: float
    """T_gpu: one trainer step on the accelerator, without logging."""
    replay_step_seconds: float
    """T_rep: one record replayed by the shadow at its chosen thread count."""
    snapshot_cost_seconds: float
    """C_snap: the shadow's copy of its replica into a snapshot (replay waits)."""
    persist_seconds: float
    """T_per: writing one snapshot to durable storage."""
    restart_seconds: float = 0.0
    """Restarting a failed trainer (or its placement group after a host failure)."""
    load_seconds: float | None = None
    """Copying a host-memory image into the trainer; None: snapshot_cost_seconds."""
    storage_read_seconds: float | None = None
    """Reading a durable image (snapshot, checkpoint, base model); None: persist_seconds."""
    recovery_replay_step_seconds: float | None = None
    """T_rec: replaying one record on the recovering trainer's device; None: replay_step_seconds."""
    log_step_seconds: float = 0.0
    """Critical-path cost of publishing one step record."""
    state_copy_seconds: float | None = None
    """C_copy: blocking copy of the trainer's state (resync); None: snapshot_cost_seconds."""
    checkpoint_save_seconds: float | None = None
    """Writing one full checkpoint; None: persist_seconds."""

    @field_validator(*_REQUIRED_TIMES)
    @classmethod
    def _positive(cls, value: float, info) -> float:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{info.field_name} must be a positive, finite number of seconds, got {value!r}")
        return value

    @field_validator(*_OPTIONAL_TIMES)
    @classmethod
    def _non_negative(cls, value: float | None, info) -> float | None:
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{info.field_name} must be a finite number of seconds >= 0, got {value!r}")
        return value

    @property
    def load(self) -> float:
        return self.snapshot_cost_seconds if self.load_seconds is None else self.load_seconds

    @property
    def storage_read(self) -> float:
        return self.persist_seconds if self.storage_read_seconds is None else self.storage_read_seconds

    @property
    def recovery_replay_step(self) -> float:
        rec = self.recovery_replay_step_seconds
        return self.replay_step_seconds if rec is None else rec

    @property
    def state_copy(self) -> float:
        return self.snapshot_cost_seconds if self.state_copy_seconds is None else self.state_copy_seconds

    @property
    def checkpoint_save(self) -> float:
        save = self.checkpoint_save_seconds
        return self.persist_seconds if save is None else save

    @property
    def trainer_step(self) -> float:
        """The trainer's critical-path step: T_t = T_gpu + per-step logging."""
        return self.gpu_step_seconds + self.log_step_seconds


class FailureModel(BaseModel):
    """Failures arrive as a Poisson process on the training clock."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mtbf_hours: float
    """Mean time between failures, in hours of training."""
    failure_kind: FailureKind = "software"
    """`software`: the trainer process dies; `host`: the node is lost."""
    run_hours: float | None = None
    """Training hours of the whole run (log-only replays from its start); None: one MTBF."""

    @field_validator("mtbf_hours")
    @classmethod
    def _mtbf(cls, value: float) -> float:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"mtbf_hours must be a positive, finite number of hours, got {value!r}")
        return value

    @field_validator("run_hours")
    @classmethod
    def _run(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"run_hours must be a positive, finite number of hours, got {value!r}")
        return value

    @property
    def mtbf_seconds(self) -> float:
        return self.mtbf_hours * SECONDS_PER_HOUR

    @property
    def run_seconds(self) -> float:
        return self.mtbf_seconds if self.run_hours is None else self.run_hours * SECONDS_PER_HOUR


def check_failure_model(timings: Timings, failures: FailureModel) -> None:
    """Reject an MTBF that does not cover one training step (M > T_t)."""
    if failures.mtbf_seconds <= timings.trainer_step:
        raise PolicyInputError(
            "mtbf_hours",
            f"an MTBF of {failures.mtbf_hours!r} h ({failures.mtbf_seconds:g} s) is not longer than "
            f"one training step ({timings.trainer_step:g} s); give the mean time between failures in hours",
        )


def _check_interval(n: int, name: str = "snapshot_interval") -> int:
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise PolicyInputError(name, f"must be an integer >= 1, got {n!r}")
    return int(n)


def _check_positive(value: float, name: str) -> float:
    if not (math.isfinite(value) and value > 0):
        raise PolicyInputError(name, f"must be a positive, finite number, got {value!r}")
    return float(value)


def regime(timings: Timings) -> Regime:
    """`keep-pace` when replay is faster than the GPU step, else `lag`."""
    return "keep-pace" if timings.replay_step_seconds < timings.gpu_step_seconds else "lag"


def pacing_bound(timings: Timings) -> float | None:
    """C_snap / (T_gpu - T_rep): the least N that keeps the shadow at the trainer's pace; None in lag."""
    if regime(timings) == "lag":
        return None
    return timings.snapshot_cost_seconds / (timings.gpu_step_seconds - timings.replay_step_seconds)


def persistence_bound(timings: Timings) -> float:
    """T_per / T_rep: the least N with one snapshot write in flight."""
    return timings.persist_seconds / timings.replay_step_seconds


DEFAULT_STORAGE_SHARE = 0.1
"""The most of a run's time the shadow spends writing snapshots, by default."""


def durable_interval(timings: Timings, n: int, storage_share: float = DEFAULT_STORAGE_SHARE) -> int:
    """The smallest multiple of N whose write takes at most `storage_share` of the training time."""
    n = _check_interval(n)
    _check_positive(storage_share, "storage_share")
    if storage_share > 1:
        raise PolicyInputError("storage_share", f"must be at most 1 (a fraction of the run's time), got {storage_share!r}")
    multiple = max(1, math.ceil(timings.persist_seconds / (storage_share * timings.trainer_step * n)))
    return multiple * n


def keep_pace_interval(timings: Timings) -> int:
    """N*: the smallest N >= 1 meeting both bounds (keep-pace only)."""
    pacing = pacing_bound(timings)
    if pacing is None:
        raise PolicyInputError(
            "replay_step_seconds",
            f"replay ({timings.replay_step_seconds:g} s) is not faster than the GPU step "
            f"({timings.gpu_step_seconds:g} s): the lag regime has no pacing bound; use lag_interval",
        )
    return max(1, math.ceil(pacing), math.ceil(persistence_bound(timings)))


def lag_objective(timings: Timings, n: int, window_seconds: float) -> float:
    """J(N) = W * C_snap / (N * T_rep) + N * T_rep / 2: snapshot-induced lag over a window W plus the mean
    residual replay."""
    t_rep = timings.replay_step_seconds
    return window_seconds * timings.snapshot_cost_seconds / (n * t_rep) + n * t_rep / 2


def lag_interval(timings: Timings, window_seconds: float) -> int:
    """N for the lag regime: the integer minimiser of the convex `lag_objective`, at least the persistence bound."""
    window_seconds = _check_positive(window_seconds, "window_seconds")
    x = math.sqrt(2 * window_seconds * timings.snapshot_cost_seconds) / timings.replay_step_seconds
    candidates = {max(1, math.floor(x)), max(1, math.ceil(x))}
    best = min(sorted(candidates), key=lambda n: lag_objective(timings, n, window_seconds))
    return max(best, math.ceil(persistence_bound(timings)))


def lag_window_seconds(timings: Timings, failures: FailureModel, lag_bound_steps: float) -> float:
    """The window W = M C_copy / (L T_rec) for `lag_interval` when resyncs cap the lag at L steps."""
    lag_bound_steps = _check_positive(lag_bound_steps, "lag_bound_steps")
    return failures.mtbf_seconds * timings.state_copy / (lag_bound_steps * timings.recovery_replay_step)


def snapshot_interval(
    timings: Timings, failures: FailureModel | None = None, lag_bound_steps: float | None = None
) -> int:
    """The policy's N in closed form (in lag with a failure model, the fixed point of N = lag_interval(W(L)));
    `waste.configure` polishes it."""
    if regime(timings) == "keep-pace":
        return keep_pace_interval(timings)
    if lag_bound_steps is not None:
        _check_positive(lag_bound_steps, "lag_bound_steps")
    if failures is None:
        return max(1, math.ceil(persistence_bound(timings)))
    check_failure_model(timings, failures)
    window, seen = failures.mtbf_seconds, set()
    while True:  # N -> L(N) -> W(L) -> N is a map on a bounded set of integers, so it cycles
        n = lag_interval(timings, window)
        bound = lag_bound_steps if lag_bound_steps is not None else optimal_lag_bound_steps(timings, n, failures)
        if bound is None or n in seen:  # no lag at this N, or the iteration has settled
            return n
        seen.add(n)
        window = lag_window_seconds(timings, failures, bound)


def shadow_step_seconds(timings: Timings, n: int) -> float:
    """T_eff = T_rep + C_snap / N: the shadow's mean time per step."""
    n = _check_interval(n)
    return timings.replay_step_seconds + timings.snapshot_cost_seconds / n


def lag_growth_steps_per_second(timings: Timings, n: int) -> float:
    """r(N) = 1 / T_t - 1 / T_eff: how fast the shadow falls behind, in steps per second."""
    return max(0.0, 1.0 / timings.trainer_step - 1.0 / shadow_step_seconds(timings, n))


def resync_interval_seconds(timings: Timings, n: int, lag_bound_steps: float) -> float | None:
    """Training seconds between resyncs that keep the lag under L steps (None: it keeps pace)."""
    lag_bound_steps = _check_positive(lag_bound_steps, "lag_bound_steps")
    rate = lag_growth_steps_per_second(timings, n)
    return None if rate == 0 else lag_bound_steps / rate


def optimal_lag_bound_steps(timings: Timings, n: int, failures: FailureModel) -> float | None:
    """L* = sqrt(2 * M * r(N) * C_copy / T_rec), at least 1: resync copies against the lag replayed after a
    failure; None in keep-pace."""
    check_failure_model(timings, failures)
    rate = lag_growth_steps_per_second(timings, n)
    if rate == 0:
        return None
    bound = math.sqrt(2 * failures.mtbf_seconds * rate * timings.state_copy / timings.recovery_replay_step)
    return max(1.0, bound)


def should_resync(lag_steps: float, lag_bound_steps: float | None) -> bool:
    """The controller's live check: resync once the shadow is L or more steps behind."""
    return lag_bound_steps is not None and lag_steps >= lag_bound_steps


def young_daly_interval(checkpoint_seconds: float, mtbf_seconds: float, step_seconds: float) -> int:
    """K = sqrt(2 * C * M) / T_step rounded, at least 1 (Young-Daly)."""
    _check_positive(checkpoint_seconds, "checkpoint_seconds")
    _check_positive(mtbf_seconds, "mtbf_seconds")
    _check_positive(step_seconds, "step_seconds")
    return max(1, round(math.sqrt(2 * checkpoint_seconds * mtbf_seconds) / step_seconds))


def availability_delay_steps(timings: Timings, failure_kind: FailureKind) -> float:
    """Steps before a keep-pace snapshot is usable: 1, plus T_per / T_t after a host failure."""
    if failure_kind == "software":
        return 1.0
    return 1.0 + timings.persist_seconds / timings.trainer_step


def expected_replay_distance(n: int, delay_steps: float = 1.0) -> float:
    """Mean records replayed after a keep-pace failure: N / 2 + delay."""
    n = _check_interval(n)
    if not (math.isfinite(delay_steps) and delay_steps >= 0):
        raise PolicyInputError("delay_steps", f"must be a finite number >= 0, got {delay_steps!r}")
    return n / 2 + delay_steps


def keep_pace_recovery_seconds(timings: Timings, n: int, failure_kind: FailureKind = "software") -> float:
    """Expected recovery after a keep-pace failure."""
    distance = expected_replay_distance(n, availability_delay_steps(timings, failure_kind))
    if failure_kind == "software":
        return timings.restart_seconds + timings.load + distance * timings.recovery_replay_step
    return (timings.restart_seconds + timings.storage_read + distance * timings.replay_step_seconds
            + timings.load)
