"""`plan`: everything the controller and `zocheck-ray plan` report, in one call.

    >>> from zocheck_ray.policies import Timings, FailureModel, plan
    >>> p = plan(Timings(gpu_step_seconds=2.85, replay_step_seconds=3.68,
    ...                  snapshot_cost_seconds=2.0, persist_seconds=10.0),
    ...          FailureModel(mtbf_hours=1))
    >>> p.regime, p.snapshot_interval
    ('lag', 5)
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from zocheck_ray.policies.cost_model import (
    DEFAULT_STORAGE_SHARE,
    FailureModel,
    Regime,
    Timings,
    _check_interval,
    _check_positive,
    availability_delay_steps,
    check_failure_model,
    durable_interval,
    expected_replay_distance,
    keep_pace_recovery_seconds,
    lag_growth_steps_per_second,
    pacing_bound,
    persistence_bound,
    regime,
    resync_interval_seconds,
    snapshot_interval,
)
from zocheck_ray.policies.waste import STRATEGIES, WasteEstimate, configure, expected_waste


class Plan(BaseModel):
    """The policy's decisions and the numbers behind them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pacing_bound: float | None
    """C_snap / (T_gpu - T_rep); None in the lag regime (no N keeps pace)."""
    persistence_bound: float
    """T_per / T_rep."""
    regime: Regime
    """`keep-pace` (T_rep < T_gpu) or `lag`."""
    snapshot_interval: int
    """N: replayed steps between snapshots."""
    durable_interval: int
    """Steps between durable snapshots: a multiple of N whose writes take at most `storage_share` of the time."""
    storage_share: float
    """The most of the run's time the shadow spends writing snapshots to storage."""
    replay_threads: int | None = None
    """Shadow replay threads, when chosen by a startup profile."""
    lag_growth_steps_per_second: float
    """How fast the shadow falls behind at this N (0 when it keeps pace)."""
    lag_bound_steps: float | None
    """Resync once the shadow is this many steps behind; None when it keeps pace or no MTBF."""
    resync_interval_seconds: float | None
    """Training seconds between resyncs at that bound; None when no resync is needed."""
    expected_replay_distance_steps: float | None
    """Mean records replayed after a failure; None in the lag regime without an MTBF."""
    expected_recovery_seconds: float | None
    """Mean recovery time per failure; None in the lag regime without an MTBF."""
    failures: FailureModel | None
    """The failure model the plan was made for, if any."""
    waste: dict[str, WasteEstimate]
    """Expected waste per failure window for each strategy (empty without an MTBF)."""
    notes: list[str]
    """What the plan assumed where the inputs left a choice."""


def _without_failures(timings: Timings, kind: str, lag_bound_steps: float | None, notes: list[str]):
    """N, the resync bound, and (keep-pace only) the replay distance and recovery time, with no MTBF."""
    n = snapshot_interval(timings)
    if kind != "keep-pace":
        notes.append("lag regime without an MTBF: N is the persistence bound; give mtbf_hours "
                     "to balance snapshots against replay and to choose the resync bound")
        return n, lag_bound_steps, None, None
    distance = expected_replay_distance(n, availability_delay_steps(timings, "software"))
    return n, lag_bound_steps, distance, keep_pace_recovery_seconds(timings, n, "software")


def plan(
    timings: Timings,
    failures: FailureModel | None = None,
    *,
    lag_bound_steps: float | None = None,
    checkpoint_interval_steps: int | None = None,
    replay_threads: int | None = None,
    storage_share: float = DEFAULT_STORAGE_SHARE,
) -> Plan:
    """Bounds, regime, N, resync bound and expected waste for every strategy; without a failure model a lag plan
    snapshots at the persistence bound and leaves the resync bound to the caller."""
    if lag_bound_steps is not None:
        _check_positive(lag_bound_steps, "lag_bound_steps")
    if checkpoint_interval_steps is not None:
        _check_interval(checkpoint_interval_steps, "checkpoint_interval_steps")
    notes: list[str] = []
    kind = regime(timings)
    waste: dict[str, WasteEstimate] = {}
    if failures is None:
        n, bound, distance, recovery = _without_failures(timings, kind, lag_bound_steps, notes)
    else:
        check_failure_model(timings, failures)
        for strategy in STRATEGIES:
            config = configure(timings, failures, strategy, lag_bound_steps=lag_bound_steps,
                               checkpoint_interval_steps=checkpoint_interval_steps)
            waste[strategy] = expected_waste(timings, failures, config)
        zocheck = waste["zocheck"]
        n, bound = zocheck.config.snapshot_interval, zocheck.config.lag_bound_steps
        distance, recovery = zocheck.replay_distance_steps, zocheck.recovery_seconds
    rate = lag_growth_steps_per_second(timings, n)
    if rate == 0:
        if bound is not None:
            notes.append("the shadow keeps pace, so the resync bound is not needed")
        bound = None
    interval = None if bound is None else resync_interval_seconds(timings, n, bound)
    if kind == "keep-pace" and failures is not None and n * timings.trainer_step > failures.mtbf_seconds:
        notes.append(f"N = {n} steps spans more than one MTBF: replay is nearly as slow as the GPU, "
                     "so most failures will replay from an old snapshot")
    if kind == "lag" and rate == 0:
        notes.append("replay is slower than the GPU step, but the per-step logging cost lets the shadow keep up")
    pace = pacing_bound(timings)
    return Plan(
        pacing_bound=pace,
        persistence_bound=persistence_bound(timings),
        regime=kind,
        snapshot_interval=n,
        durable_interval=durable_interval(timings, n, storage_share),
        storage_share=storage_share,
        replay_threads=replay_threads,
        lag_growth_steps_per_second=rate,
        lag_bound_steps=bound,
        resync_interval_seconds=interval,
        expected_replay_distance_steps=distance,
        expected_recovery_seconds=recovery,
        failures=failures,
        waste=waste,
        notes=notes,
    )
