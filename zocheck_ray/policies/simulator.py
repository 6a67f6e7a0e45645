"""Monte-Carlo estimate of wasted time under exponentially distributed failures.

Each trial runs the strategy's mechanics on one sampled failure window, so the closed forms of
`waste.py` are checked, not trusted.

    >>> from zocheck_ray.policies import Timings, FailureModel, configure, simulate_waste
    >>> t = Timings(gpu_step_seconds=8.65, replay_step_seconds=6.59,
    ...             snapshot_cost_seconds=4.0, persist_seconds=20.0)
    >>> f = FailureModel(mtbf_hours=24)
    >>> r = simulate_waste(t, f, configure(t, f, "sync-checkpoint"), trials=1000, seed=0)
    >>> r.ci_low_seconds < r.mean_seconds < r.ci_high_seconds
    True
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
from pydantic import BaseModel, ConfigDict

from zocheck_ray.policies.cost_model import (
    FailureKind,
    FailureModel,
    PolicyInputError,
    Timings,
    availability_delay_steps,
    check_failure_model,
    lag_growth_steps_per_second,
    shadow_step_seconds,
)
from zocheck_ray.policies.waste import StrategyConfig, checkpoint_cycle


class SimulationResult(BaseModel):
    """Monte-Carlo wasted time per failure window for one strategy and MTBF."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: StrategyConfig
    """The strategy and its parameters."""
    mtbf_hours: float
    """The MTBF simulated."""
    failure_kind: FailureKind
    """Software or host failures."""
    trials: int
    """Failure windows sampled."""
    seed: int
    """Seed of the numpy Generator; the same seed gives the same result."""
    confidence: float
    """Confidence level of the interval."""
    mean_seconds: float
    """Mean wasted time per failure window."""
    ci_low_seconds: float
    """Lower end of the confidence interval of the mean."""
    ci_high_seconds: float
    """Upper end of the confidence interval of the mean."""
    waste_fraction: float
    """Summed waste over summed wall-clock time: the share of a long run wasted."""


def _zocheck(timings: Timings, failures: FailureModel, config: StrategyConfig, x, rng):
    n = config.snapshot_interval
    log_share = timings.log_step_seconds / timings.trainer_step
    rate = lag_growth_steps_per_second(timings, n)
    kind = failures.failure_kind
    if rate == 0:
        delay = availability_delay_steps(timings, kind)
        progress = rng.uniform(0.0, n, x.size) + x / timings.trainer_step
        distance = np.mod(progress - delay, n) + delay
        overhead = x * log_share
        closing = 0.0
    else:
        if config.lag_bound_steps is None:
            raise PolicyInputError("lag_bound_steps", "the shadow lags, so a resync bound L (steps) is required")
        t_eff = shadow_step_seconds(timings, n)
        active_span = config.lag_bound_steps / rate
        period = active_span + timings.state_copy
        cycles = np.floor(x / period)
        position = x - cycles * period
        active = np.minimum(position, active_span)
        distance = rate * active + np.mod(active / t_eff, n)
        overhead = ((cycles * active_span + active) * log_share + cycles * timings.state_copy
                    + (position - active))
        if kind == "host":
            distance = distance + timings.persist_seconds / t_eff
        closing = timings.state_copy
    if kind == "software":
        recovery = timings.restart_seconds + timings.load + distance * timings.recovery_replay_step
    else:
        recovery = (timings.restart_seconds + timings.storage_read + distance * timings.replay_step_seconds
                    + timings.load)
    recovery = recovery + closing
    return overhead + recovery, x + recovery


def _log_only(timings: Timings, failures: FailureModel, x, rng):
    elapsed = rng.uniform(0.0, failures.run_seconds, x.size)
    recovery = (timings.restart_seconds + timings.storage_read
                + elapsed / timings.trainer_step * timings.recovery_replay_step)
    waste = x * timings.log_step_seconds / timings.trainer_step + recovery
    return waste, x + recovery


def _checkpoint(timings: Timings, config: StrategyConfig, x):
    k = config.checkpoint_interval_steps
    _, period = checkpoint_cycle(timings, config.strategy, k)
    if config.strategy == "sync-checkpoint":
        kept = np.floor(x / period)
    else:
        kept = np.maximum(0.0, np.floor((x - timings.checkpoint_save) / period))
    restart = timings.restart_seconds + timings.storage_read
    return x - kept * k * timings.gpu_step_seconds + restart, x + restart


def simulate_waste(
    timings: Timings,
    failures: FailureModel,
    config: StrategyConfig,
    *,
    trials: int = 20_000,
    seed: int = 0,
    confidence: float = 0.95,
) -> SimulationResult:
    """Sample `trials` failure windows and estimate the mean waste with a normal interval."""
    check_failure_model(timings, failures)
    if isinstance(trials, bool) or int(trials) != trials or trials < 2:
        raise PolicyInputError("trials", f"must be an integer >= 2, got {trials!r}")
    if not (0.0 < confidence < 1.0):
        raise PolicyInputError("confidence", f"must be in (0, 1), got {confidence!r}")
    if config.strategy == "zocheck" and config.snapshot_interval is None:
        raise PolicyInputError("snapshot_interval", "zocheck needs a snapshot interval N")
    if config.strategy.endswith("checkpoint") and config.checkpoint_interval_steps is None:
        raise PolicyInputError("checkpoint_interval_steps", f"{config.strategy} needs an interval K")
    rng = np.random.default_rng(seed)
    x = rng.exponential(failures.mtbf_seconds, int(trials))
    if config.strategy == "zocheck":
        waste, wall = _zocheck(timings, failures, config, x, rng)
    elif config.strategy == "log-only":
        waste, wall = _log_only(timings, failures, x, rng)
    else:
        waste, wall = _checkpoint(timings, config, x)
    mean = float(np.mean(waste))
    half = NormalDist().inv_cdf(0.5 + confidence / 2) * float(np.std(waste, ddof=1)) / math.sqrt(trials)
    return SimulationResult(
        config=config, mtbf_hours=failures.mtbf_hours, failure_kind=failures.failure_kind,
        trials=int(trials), seed=seed, confidence=confidence, mean_seconds=mean,
        ci_low_seconds=mean - half, ci_high_seconds=mean + half,
        waste_fraction=float(np.sum(waste) / np.sum(wall)),
    )
