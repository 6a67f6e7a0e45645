"""Policies: the ZOCheck cost model, the startup profile, lag control and a wasted-time simulator.

Ray-free and pure: pydantic inputs and outputs, usable from the CLI and the controller.

    >>> from zocheck_ray.policies import Timings, plan
    >>> plan(Timings(gpu_step_seconds=8.65, replay_step_seconds=6.59,
    ...              snapshot_cost_seconds=4.0, persist_seconds=20.0)).snapshot_interval
    4
"""

from zocheck_ray.policies.cost_model import (
    FailureKind,
    FailureModel,
    PolicyInputError,
    Regime,
    Timings,
    availability_delay_steps,
    check_failure_model,
    expected_replay_distance,
    durable_interval,
    keep_pace_interval,
    keep_pace_recovery_seconds,
    lag_growth_steps_per_second,
    lag_interval,
    lag_objective,
    lag_window_seconds,
    optimal_lag_bound_steps,
    pacing_bound,
    persistence_bound,
    regime,
    resync_interval_seconds,
    shadow_step_seconds,
    should_resync,
    snapshot_interval,
    young_daly_interval,
)
from zocheck_ray.policies.planner import Plan, plan
from zocheck_ray.policies.profile import (
    MAX_PROFILE_STEPS,
    KnownTimings,
    ProfileReport,
    ProfileSettings,
    profile_startup,
)
from zocheck_ray.policies.simulator import SimulationResult, simulate_waste
from zocheck_ray.policies.waste import (
    STRATEGIES,
    Strategy,
    StrategyConfig,
    WasteEstimate,
    configure,
    expected_waste,
)

__all__ = [
    "Timings", "FailureModel", "FailureKind", "Regime", "PolicyInputError",
    "pacing_bound", "persistence_bound", "regime", "durable_interval", "keep_pace_interval", "lag_interval",
    "lag_objective", "lag_window_seconds", "snapshot_interval", "shadow_step_seconds",
    "lag_growth_steps_per_second", "resync_interval_seconds", "optimal_lag_bound_steps",
    "should_resync", "young_daly_interval", "availability_delay_steps", "expected_replay_distance",
    "keep_pace_recovery_seconds", "check_failure_model",
    "Strategy", "STRATEGIES", "StrategyConfig", "WasteEstimate", "configure", "expected_waste",
    "Plan", "plan", "SimulationResult", "simulate_waste",
    "ProfileSettings", "KnownTimings", "ProfileReport", "profile_startup", "MAX_PROFILE_STEPS",
]
