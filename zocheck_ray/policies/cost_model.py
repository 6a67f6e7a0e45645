"""The ZOCheck cost model: how many replayed steps between snapshots, and when to resync.

Symbols (DESIGN.md section 5), all in seconds unless a name says otherwise:

    T_gpu   gpu_step_seconds       trainer step on the accelerator (forward passes + update)
    T_rep   replay_step_seconds    shadow replay of one step record on the CPU
    C_snap  snapshot_cost_seconds  shadow copy of its replica into a snapshot (blocks replay)
    T_per   persist_seconds        write of one snapshot to durable storage (one in flight)
    N       snapshot interval      replayed steps between snapshots
    M       MTBF                   mean training time between failures (mtbf_hours * 3600)

Bounds on N:

    pacing       T_rep + C_snap / N <= T_gpu   ->  N >= C_snap / (T_gpu - T_rep)   (T_rep < T_gpu)
    persistence  N * T_rep >= T_per            ->  N >= T_per / T_rep

The persistence bound assumes the shadow replays at full speed (as after a backlog), the
conservative case; a paced shadow has even more time per snapshot.

Regimes: keep-pace when T_rep < T_gpu, lag when T_rep >= T_gpu (the pacing bound has no
solution). In keep-pace, N* = max(1, ceil(pacing), ceil(persistence)): no snapshot-induced
lag, and no dependence on M. After a failure the trainer replays the records since the
newest usable snapshot: 1 + N/2 on average (the failure's phase in the snapshot period is
uniform, and the snapshot is usable one step after its boundary). In the lag regime (or
below the pacing bound) the shadow falls behind at

    r(N) = 1 / T_t - 1 / (T_rep + C_snap / N)     steps per second, T_t = T_gpu + logging

(equivalently the replay backlog grows by (T_rep + C_snap/N - T_t) / T_t seconds per
second; progress is treated as fluid, in fractional steps, in the lag terms). Snapshotting
less often slows the lag but lengthens the residual replay, so N minimises
J(N) = W * C_snap / (N * T_rep) + N * T_rep / 2 over a window W:
N ~ sqrt(2 * W * C_snap) / T_rep, the Young-Daly square root (`lag_interval`). A resync
(one blocking copy of the trainer's state, cost C_copy) caps the lag at L steps; it is due
every L / r(N) seconds, and the L that balances resync copies against lag replay is again
Young-Daly: L* = sqrt(2 * M * r(N) * C_copy / T_rec). With resyncs the window in J is not
M but W = M * C_copy / (L * T_rec) (`lag_window_seconds`); N and L are solved together.

Expected wasted time per failure window, for ZOCheck and the baselines, is in `waste.py`.

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
    """Inputs that are valid one by one but not together (e.g. an MTBF shorter than a step)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


_REQUIRED_TIMES = ("gpu_step_seconds", "replay_step_seconds", "snapshot_cost_seconds", "persist_seconds")
_OPTIONAL_TIMES = (
    "restart_seconds", "load_seconds", "storage_read_seconds", "recovery_replay_step_seconds",
    "log_step_seconds", "state_copy_seconds", "checkpoint_save_seconds",
)


class Timings(BaseModel):
    """Measured (or assumed) costs; the first four are the DESIGN.md section 5 inputs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_step_seconds: float
    """T_gpu: one trainer step on the accelerator, without logging."""
    replay_step_seconds: float
    """T_rep: one step record replayed by the shadow on the CPU at its chosen thread count."""
    snapshot_cost_seconds: float
    """C_snap: the shadow's copy of its replica into an in-memory snapshot (replay waits)."""
    persist_seconds: float
    """T_per: writing one snapshot to durable storage (local path or object store)."""
    restart_seconds: float = 0.0
    """Restarting a failed trainer (software) or rescheduling the placement group (host)."""
    load_seconds: float | None = None
    """Copying a host-memory image into the trainer; None: same as snapshot_cost_seconds."""
    storage_read_seconds: float | None = None
    """Reading a durable image (snapshot, full checkpoint, base model); None: persist_seconds."""
    recovery_replay_step_seconds: float | None = None
    """T_rec: replaying one record on the recovering trainer's device; None: replay_step_seconds."""
    log_step_seconds: float = 0.0
    """Critical-path cost of publishing one step record (ZOCheck and log-only)."""
    state_copy_seconds: float | None = None
    """C_copy: blocking device-to-host copy of the trainer's state (async staging, ZOCheck
    resync); None: same as snapshot_cost_seconds."""
    checkpoint_save_seconds: float | None = None
    """Writing one full checkpoint to storage (sync baseline; the async write); None: persist_seconds."""

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
    """Failures arrive as a Poisson process on the training clock (recovery time excluded)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mtbf_hours: float
    """Mean time between failures, in hours of training."""
    failure_kind: FailureKind = "software"
    """`software`: the trainer process dies, the shadow survives; `host`: the node is lost."""
    run_hours: float | None = None
    """Training hours of the whole run (log-only replays since its start); None: one MTBF."""

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
    """Reject an MTBF that does not cover one training step (the model needs M > T_t)."""
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
    """`keep-pace` when replay is faster than the GPU step (T_rep < T_gpu), else `lag`."""
    return "keep-pace" if timings.replay_step_seconds < timings.gpu_step_seconds else "lag"


def pacing_bound(timings: Timings) -> float | None:
    """C_snap / (T_gpu - T_rep): the least N at which snapshots do not slow the shadow
    below the trainer; None in the lag regime, where no N achieves it."""
    if regime(timings) == "lag":
        return None
    return timings.snapshot_cost_seconds / (timings.gpu_step_seconds - timings.replay_step_seconds)


def persistence_bound(timings: Timings) -> float:
    """T_per / T_rep: the least N at which one snapshot write is in flight at a time."""
    return timings.persist_seconds / timings.replay_step_seconds


DEFAULT_STORAGE_SHARE = 0.1
"""The most of a run's time the shadow spends writing snapshots to durable storage, by default."""


def durable_interval(timings: Timings, n: int, storage_share: float = DEFAULT_STORAGE_SHARE) -> int:
    """Steps between durable snapshots: the smallest multiple of N at which writing one (T_per) takes at
    most `storage_share` of the training time between them (N_d * T_t >= T_per / share).

    In-memory snapshots are a memory copy; a durable one writes the whole state to storage. Where the
    shadow keeps pace with a small N, persisting every image would write the state at the training's
    own pace (a 2 GB image to S3 every few steps). Between durable snapshots the step log is durable
    on its own: a lost node replays it from the last durable snapshot.
    """
    n = _check_interval(n)
    _check_positive(storage_share, "storage_share")
    if storage_share > 1:
        raise PolicyInputError("storage_share", f"must be at most 1 (a fraction of the run's time), got {storage_share!r}")
    multiple = max(1, math.ceil(timings.persist_seconds / (storage_share * timings.trainer_step * n)))
    return multiple * n


def keep_pace_interval(timings: Timings) -> int:
    """N*: the smallest integer N >= 1 meeting both bounds (keep-pace regime only).

    It does not depend on the failure rate: in keep-pace the shadow is never behind, so a
    larger N only lengthens the replay after a failure.
    """
    pacing = pacing_bound(timings)
    if pacing is None:
        raise PolicyInputError(
            "replay_step_seconds",
            f"replay ({timings.replay_step_seconds:g} s) is not faster than the GPU step "
            f"({timings.gpu_step_seconds:g} s): the lag regime has no pacing bound; use lag_interval",
        )
    return max(1, math.ceil(pacing), math.ceil(persistence_bound(timings)))


def lag_objective(timings: Timings, n: int, window_seconds: float) -> float:
    """J(N) = W * C_snap / (N * T_rep) + N * T_rep / 2: snapshot-induced lag over a window W
    plus the mean residual replay since the newest snapshot, both in seconds of replay."""
    t_rep = timings.replay_step_seconds
    return window_seconds * timings.snapshot_cost_seconds / (n * t_rep) + n * t_rep / 2


def lag_interval(timings: Timings, window_seconds: float) -> int:
    """N for the lag regime: the integer minimiser of `lag_objective` over the failure
    window W, at least the persistence bound. The real minimiser sqrt(2 W C_snap) / T_rep
    grows as the square root of W (Young-Daly); J is convex, so its floor or ceiling wins.
    """
    window_seconds = _check_positive(window_seconds, "window_seconds")
    x = math.sqrt(2 * window_seconds * timings.snapshot_cost_seconds) / timings.replay_step_seconds
    candidates = {max(1, math.floor(x)), max(1, math.ceil(x))}
    best = min(sorted(candidates), key=lambda n: lag_objective(timings, n, window_seconds))
    return max(best, math.ceil(persistence_bound(timings)))


def lag_window_seconds(timings: Timings, failures: FailureModel, lag_bound_steps: float) -> float:
    """The window W to put in `lag_interval` when resyncs cap the lag at L steps.

    Snapshots only raise the lag growth rate r(N) ~ r_inf + C_snap / (N T_rep^2), and with
    a bound L that costs resyncs, M r(N) C_copy / L per failure window; N's residual replay
    costs N T_rec / 2. Their sum is J(N) (times T_rec / T_rep) for W = M C_copy / (L T_rec).
    """
    lag_bound_steps = _check_positive(lag_bound_steps, "lag_bound_steps")
    return failures.mtbf_seconds * timings.state_copy / (lag_bound_steps * timings.recovery_replay_step)


def snapshot_interval(
    timings: Timings, failures: FailureModel | None = None, lag_bound_steps: float | None = None
) -> int:
    """The policy's N in closed form.

    keep-pace: `keep_pace_interval`. lag, no failure model: the persistence bound (snapshot
    as often as storage allows; resyncs cap the lag). lag with a failure model: the fixed
    point of N = lag_interval(W) and W = `lag_window_seconds` at the resync bound L (given,
    or `optimal_lag_bound_steps` at N), started from W = M. `waste.configure` then polishes
    N on the exact expected waste.
    """
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
    """T_eff = T_rep + C_snap / N: the shadow's mean time per step, snapshots amortised."""
    n = _check_interval(n)
    return timings.replay_step_seconds + timings.snapshot_cost_seconds / n


def lag_growth_steps_per_second(timings: Timings, n: int) -> float:
    """r(N) = 1 / T_t - 1 / T_eff: how fast the shadow falls behind, in steps per second of
    training (0 when it keeps pace). T_t includes the per-step logging cost."""
    return max(0.0, 1.0 / timings.trainer_step - 1.0 / shadow_step_seconds(timings, n))


def resync_interval_seconds(timings: Timings, n: int, lag_bound_steps: float) -> float | None:
    """Training seconds between resyncs that keep the lag under L steps: L / r(N); None
    when the shadow keeps pace and never needs one."""
    lag_bound_steps = _check_positive(lag_bound_steps, "lag_bound_steps")
    rate = lag_growth_steps_per_second(timings, n)
    return None if rate == 0 else lag_bound_steps / rate


def optimal_lag_bound_steps(timings: Timings, n: int, failures: FailureModel) -> float | None:
    """L* = sqrt(2 * M * r(N) * C_copy / T_rec), at least one step: resync copies cost
    M * r * C_copy / L per window, the lag replayed after a failure L * T_rec / 2 on
    average; L* balances them. None when the shadow keeps pace."""
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
    """K = sqrt(2 * C * M) / T_step rounded to the nearest integer, at least 1: the
    first-order optimum of C / (K T_step) * M (checkpoints) + K T_step / 2 (lost work)."""
    _check_positive(checkpoint_seconds, "checkpoint_seconds")
    _check_positive(mtbf_seconds, "mtbf_seconds")
    _check_positive(step_seconds, "step_seconds")
    return max(1, round(math.sqrt(2 * checkpoint_seconds * mtbf_seconds) / step_seconds))


def availability_delay_steps(timings: Timings, failure_kind: FailureKind) -> float:
    """Steps of trainer progress before a keep-pace snapshot can be recovered from: the
    shadow trails by the record in flight (1 step); after a host failure the snapshot must
    also be durable, T_per later (T_per / T_t more steps)."""
    if failure_kind == "software":
        return 1.0
    return 1.0 + timings.persist_seconds / timings.trainer_step


def expected_replay_distance(n: int, delay_steps: float = 1.0) -> float:
    """Mean records replayed after a keep-pace failure: N / 2 + delay (1 + N / 2 for a
    software failure). The failure's phase in the snapshot period is uniform; a snapshot
    `delay` steps old is not yet usable, so the distance is ((p - delay) mod N) + delay."""
    n = _check_interval(n)
    if not (math.isfinite(delay_steps) and delay_steps >= 0):
        raise PolicyInputError("delay_steps", f"must be a finite number >= 0, got {delay_steps!r}")
    return n / 2 + delay_steps


def keep_pace_recovery_seconds(timings: Timings, n: int, failure_kind: FailureKind = "software") -> float:
    """Expected recovery after a keep-pace failure.

    software: restart + load the shadow's image + replay (N/2 + 1) records on the trainer (T_rec).
    host: restart + read the durable snapshot + the new shadow replays (N/2 + 1 + T_per/T_t)
    records on the CPU (T_rep) + the trainer loads the image.
    """
    distance = expected_replay_distance(n, availability_delay_steps(timings, failure_kind))
    if failure_kind == "software":
        return timings.restart_seconds + timings.load + distance * timings.recovery_replay_step
    return (timings.restart_seconds + timings.storage_read + distance * timings.replay_step_seconds
            + timings.load)
