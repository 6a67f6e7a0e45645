"""Expected wasted time per failure window, for ZOCheck and the baselines, in closed form.

A window is the training time X ~ Exponential(M) from one recovery's end to the next failure; its
waste is the critical-path overhead during X plus the recovery. The forms are exact for the
mechanics `simulator.py` samples:

zocheck, keeping pace: overhead M * log / T_t; mean replay N/2 + 1 (+ T_per / T_t after a host failure).
zocheck, lagging: the lag grows at r steps/s to L, then a resync (C_copy) resets it: cycles of
    P = L/r + C_copy, each term closed-form in Y = X mod P.
log-only: recovery replays every record since the run's start.
sync-checkpoint every K steps: E[waste] = M - K T / (e^{P/M} - 1) + restart + read, P = K T + C_save.
async-checkpoint: staging C_copy on the critical path; E[durable] = e^{-C_save/M} / (e^{P/M} - 1).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict

from zocheck_ray.policies.cost_model import (
    FailureKind,
    FailureModel,
    PolicyInputError,
    Timings,
    _check_interval,
    _check_positive,
    check_failure_model,
    availability_delay_steps,
    expected_replay_distance,
    keep_pace_recovery_seconds,
    lag_growth_steps_per_second,
    optimal_lag_bound_steps,
    persistence_bound,
    regime,
    shadow_step_seconds,
    snapshot_interval,
    young_daly_interval,
)

Strategy = Literal["zocheck", "log-only", "sync-checkpoint", "async-checkpoint"]
STRATEGIES: tuple[str, ...] = ("zocheck", "log-only", "sync-checkpoint", "async-checkpoint")


class StrategyConfig(BaseModel):
    """One strategy with its parameters fixed (for the closed form and the simulator)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: Strategy
    """Which recovery strategy."""
    snapshot_interval: int | None = None
    """zocheck: N, replayed steps between snapshots."""
    lag_bound_steps: float | None = None
    """zocheck when the shadow lags: resync once it is L steps behind."""
    checkpoint_interval_steps: int | None = None
    """Checkpoint baselines: K, training steps between full checkpoints."""


class WasteEstimate(BaseModel):
    """Expected wasted time of one failure window for one strategy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: StrategyConfig
    """The strategy and the parameters the estimate is for."""
    mtbf_hours: float
    """The failure model's MTBF."""
    failure_kind: FailureKind
    """Software or host failures."""
    overhead_seconds: float
    """Critical-path overhead paid during a window."""
    recovery_seconds: float
    """Per failure: restart, reload and replay, or recompute."""
    waste_seconds: float
    """Total wasted time per failure window: overhead + recovery."""
    waste_fraction: float
    """Long-run share of wall-clock time wasted."""
    replay_distance_steps: float | None = None
    """Mean records replayed at recovery (zocheck, log-only); None for checkpoints."""


def configure(
    timings: Timings,
    failures: FailureModel,
    strategy: Strategy,
    *,
    snapshot_interval_steps: int | None = None,
    lag_bound_steps: float | None = None,
    checkpoint_interval_steps: int | None = None,
) -> StrategyConfig:
    """Fill in a strategy's parameters (N, L*, Young-Daly's K) by policy where not given; in the lag regime N is
    polished on the exact waste."""
    check_failure_model(timings, failures)
    if lag_bound_steps is not None:
        _check_positive(lag_bound_steps, "lag_bound_steps")
    if strategy == "zocheck":
        if snapshot_interval_steps is not None:
            return _zocheck_config(timings, failures, _check_interval(snapshot_interval_steps), lag_bound_steps)
        config = _zocheck_config(timings, failures, snapshot_interval(timings, failures, lag_bound_steps),
                                 lag_bound_steps)
        if regime(timings) == "lag":
            config = _polish(timings, failures, config, lag_bound_steps)
        return config
    if strategy in ("sync-checkpoint", "async-checkpoint"):
        if checkpoint_interval_steps is None:
            cost = timings.checkpoint_save if strategy == "sync-checkpoint" else timings.state_copy
            # A zero-cost checkpoint would make K = 0; one step is the most often one can save.
            checkpoint_interval_steps = (
                1 if cost == 0 else young_daly_interval(cost, failures.mtbf_seconds, timings.gpu_step_seconds)
            )
        k = _check_interval(checkpoint_interval_steps, "checkpoint_interval_steps")
        return StrategyConfig(strategy=strategy, checkpoint_interval_steps=k)
    if strategy == "log-only":
        return StrategyConfig(strategy=strategy)
    raise PolicyInputError("strategy", f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


def _zocheck_config(timings, failures, n: int, lag_bound_steps: float | None) -> StrategyConfig:
    # Any N below the pacing bound lags too, in either regime; L* is None where nothing lags.
    if lag_bound_steps is None:
        lag_bound_steps = optimal_lag_bound_steps(timings, n, failures)
    return StrategyConfig(strategy="zocheck", snapshot_interval=n, lag_bound_steps=lag_bound_steps)


_MAX_POLISH_STEPS = 10_000


def _polish(timings, failures, config: StrategyConfig, lag_bound_steps: float | None) -> StrategyConfig:
    floor = max(1, math.ceil(persistence_bound(timings)))
    best, best_waste = config, _zocheck(timings, failures, config).waste_seconds
    for step in (-1, 1):
        for _ in range(_MAX_POLISH_STEPS):
            if best.snapshot_interval + step < floor:
                break
            trial = _zocheck_config(timings, failures, best.snapshot_interval + step, lag_bound_steps)
            waste = _zocheck(timings, failures, trial).waste_seconds
            if waste >= best_waste:
                break
            best, best_waste = trial, waste
    return best


# --- moments of Y = X mod P for X ~ Exponential(mean M) -----------------------------------


def _h(z: float) -> float:
    """1 - (1 + z) e^{-z}, with its series near 0."""
    if z < 1e-4:
        return z * z / 2 - z ** 3 / 3 + z ** 4 / 8
    return -math.expm1(-z) - z * math.exp(-z)


def _cycles(period: float, mtbf: float) -> float:
    """E[floor(X / P)] = 1 / (e^{P/M} - 1), written so that a huge period gives 0, not an overflow."""
    z = period / mtbf
    return math.exp(-z) / -math.expm1(-z)


def _beyond(a: float, period: float, mtbf: float) -> float:
    """(e^{-a/M} - e^{-P/M}) / (1 - e^{-P/M}) = P(Y >= a), for a <= P."""
    return math.exp(-a / mtbf) * -math.expm1(-(period - a) / mtbf) / -math.expm1(-period / mtbf)


def _mean_min(a: float, period: float, mtbf: float) -> float:
    """E[min(Y, a)] for a <= P."""
    inside = mtbf * _h(a / mtbf) / -math.expm1(-period / mtbf)
    return inside + a * _beyond(a, period, mtbf)


def _mean_min_mod(a: float, q: float, period: float, mtbf: float) -> float:
    """E[min(Y, a) mod Q] for a <= P."""
    whole = math.floor(a / q)
    rest = a - whole * q
    ratio = math.expm1(-whole * q / mtbf) / math.expm1(-q / mtbf) if whole else 0.0
    inside = (ratio * mtbf * _h(q / mtbf) + math.exp(-whole * q / mtbf) * mtbf * _h(rest / mtbf))
    return inside / -math.expm1(-period / mtbf) + rest * _beyond(a, period, mtbf)


# --- per strategy -------------------------------------------------------------------------


def _estimate(config, failures, overhead, recovery, wall, distance=None) -> WasteEstimate:
    waste = overhead + recovery
    return WasteEstimate(
        config=config, mtbf_hours=failures.mtbf_hours, failure_kind=failures.failure_kind,
        overhead_seconds=overhead, recovery_seconds=recovery, waste_seconds=waste,
        waste_fraction=waste / wall, replay_distance_steps=distance,
    )


def _zocheck(timings: Timings, failures: FailureModel, config: StrategyConfig) -> WasteEstimate:
    m, kind = failures.mtbf_seconds, failures.failure_kind
    n = _check_interval(config.snapshot_interval)
    log_share = timings.log_step_seconds / timings.trainer_step
    rate = lag_growth_steps_per_second(timings, n)
    if rate == 0:
        distance = expected_replay_distance(n, availability_delay_steps(timings, kind))
        recovery = keep_pace_recovery_seconds(timings, n, kind)
        return _estimate(config, failures, m * log_share, recovery, m + recovery, distance)
    if config.lag_bound_steps is None:
        raise PolicyInputError("lag_bound_steps", "the shadow lags, so a resync bound L (steps) is required")
    bound = _check_positive(config.lag_bound_steps, "lag_bound_steps")
    t_eff = shadow_step_seconds(timings, n)
    active_span = bound / rate
    period = active_span + timings.state_copy
    cycles = _cycles(period, m)
    active = _mean_min(active_span, period, m)
    copying = (m - period * cycles) - active  # E[Y] - E[min(Y, tau)]: failed mid-resync
    overhead = (cycles * active_span + active) * log_share + cycles * timings.state_copy + copying
    distance = rate * active + _mean_min_mod(active_span, n * t_eff, period, m) / t_eff
    if kind == "software":
        recovery = timings.restart_seconds + timings.load + distance * timings.recovery_replay_step
    else:
        distance += timings.persist_seconds / t_eff
        recovery = (timings.restart_seconds + timings.storage_read + distance * timings.replay_step_seconds
                    + timings.load)
    recovery += timings.state_copy  # the closing resync
    return _estimate(config, failures, overhead, recovery, m + recovery, distance)


def _log_only(timings: Timings, failures: FailureModel, config: StrategyConfig) -> WasteEstimate:
    m = failures.mtbf_seconds
    distance = failures.run_seconds / 2 / timings.trainer_step
    recovery = timings.restart_seconds + timings.storage_read + distance * timings.recovery_replay_step
    overhead = m * timings.log_step_seconds / timings.trainer_step
    return _estimate(config, failures, overhead, recovery, m + recovery, distance)


def checkpoint_cycle(timings: Timings, strategy: str, k: int) -> tuple[float, float]:
    """(critical-path cost per checkpoint, cycle length P)."""
    work = k * timings.gpu_step_seconds
    if strategy == "sync-checkpoint":
        cost = timings.checkpoint_save
    else:  # staging, plus waiting for the previous write when it outlasts K steps
        cost = timings.state_copy + max(0.0, timings.checkpoint_save - work)
    return cost, work + cost


def _checkpoint(timings: Timings, failures: FailureModel, config: StrategyConfig) -> WasteEstimate:
    m = failures.mtbf_seconds
    k = _check_interval(config.checkpoint_interval_steps, "checkpoint_interval_steps")
    cost, period = checkpoint_cycle(timings, config.strategy, k)
    cycles = _cycles(period, m)
    durable = cycles if config.strategy == "sync-checkpoint" else cycles * math.exp(-timings.checkpoint_save / m)
    lost_in_window = m - k * timings.gpu_step_seconds * durable
    overhead = cycles * cost
    restart = timings.restart_seconds + timings.storage_read
    recovery = restart + (lost_in_window - overhead)
    return _estimate(config, failures, overhead, recovery, m + restart)


def expected_waste(timings: Timings, failures: FailureModel, config: StrategyConfig) -> WasteEstimate:
    """Expected wasted time per failure window of one configured strategy.

        >>> t = Timings(gpu_step_seconds=8.65, replay_step_seconds=6.59,
        ...             snapshot_cost_seconds=4.0, persist_seconds=20.0)
        >>> f = FailureModel(mtbf_hours=24)
        >>> round(expected_waste(t, f, configure(t, f, "zocheck")).waste_seconds, 2)
        23.77
    """
    check_failure_model(timings, failures)
    if config.strategy == "zocheck":
        return _zocheck(timings, failures, config)
    if config.strategy == "log-only":
        return _log_only(timings, failures, config)
    return _checkpoint(timings, failures, config)
