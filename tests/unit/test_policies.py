"""The cost model of DESIGN.md section 5: hand-computed cases, properties, published regimes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from zocheck_ray.policies import (
    FailureModel,
    PolicyInputError,
    StrategyConfig,
    Timings,
    configure,
    durable_interval,
    expected_replay_distance,
    expected_waste,
    keep_pace_interval,
    keep_pace_recovery_seconds,
    lag_growth_steps_per_second,
    lag_interval,
    lag_window_seconds,
    optimal_lag_bound_steps,
    pacing_bound,
    persistence_bound,
    plan,
    regime,
    resync_interval_seconds,
    should_resync,
    snapshot_interval,
    young_daly_interval,
)

FAST = settings(max_examples=60, deadline=None)
seconds = st.floats(min_value=0.01, max_value=100.0, allow_nan=False, allow_infinity=False)


def qwen8b_fp32(**extra) -> Timings:
    return Timings(gpu_step_seconds=8.65, replay_step_seconds=6.59, snapshot_cost_seconds=4.0,
                   persist_seconds=20.0, **extra)


def qwen8b_bf16(**extra) -> Timings:
    return Timings(gpu_step_seconds=2.85, replay_step_seconds=3.68, snapshot_cost_seconds=2.0,
                   persist_seconds=10.0, **extra)


def timings(gpu: float, replay: float, snap: float, persist: float) -> Timings:
    return Timings(gpu_step_seconds=gpu, replay_step_seconds=replay, snapshot_cost_seconds=snap,
                   persist_seconds=persist)


def ckpt(strategy: str, k: int) -> StrategyConfig:
    return StrategyConfig(strategy=strategy, checkpoint_interval_steps=k)


# --- the published regimes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "gpu", "replay", "expected"),
    [
        ("Qwen3-8B FP32", 8.65, 6.59, "keep-pace"),
        ("Qwen3-8B BF16", 2.85, 3.68, "lag"),
        ("ZO-Adam Qwen3-1.7B", 1.70, 3.41, "lag"),
    ],
)
def test_published_regimes_are_classified_as_published(name, gpu, replay, expected):
    timings = Timings(gpu_step_seconds=gpu, replay_step_seconds=replay, snapshot_cost_seconds=1.0,
                      persist_seconds=5.0)
    assert regime(timings) == expected
    assert plan(timings).regime == expected
    assert (pacing_bound(timings) is None) == (expected == "lag")


# --- bounds and N, by hand ----------------------------------------------------------------------


def test_bounds_of_the_fp32_case():
    t = qwen8b_fp32()
    assert pacing_bound(t) == pytest.approx(4.0 / 2.06)  # 1.9417
    assert persistence_bound(t) == pytest.approx(20.0 / 6.59)  # 3.0349
    assert keep_pace_interval(t) == 4  # persistence binds: ceil(3.03)
    assert snapshot_interval(t) == 4


def test_pacing_bound_binds_when_replay_is_nearly_as_slow_as_the_gpu():
    t = Timings(gpu_step_seconds=10.0, replay_step_seconds=9.0, snapshot_cost_seconds=3.5, persist_seconds=1.0)
    assert pacing_bound(t) == pytest.approx(3.5)
    assert keep_pace_interval(t) == 4


def test_an_exact_integer_bound_is_met_not_exceeded():
    t = Timings(gpu_step_seconds=3.0, replay_step_seconds=1.0, snapshot_cost_seconds=4.0, persist_seconds=1.0)
    assert pacing_bound(t) == 2.0
    assert keep_pace_interval(t) == 2


def test_cheap_snapshots_give_n_of_one():
    t = Timings(gpu_step_seconds=10.0, replay_step_seconds=1.0, snapshot_cost_seconds=0.5, persist_seconds=0.5)
    assert keep_pace_interval(t) == 1


def test_keep_pace_interval_does_not_depend_on_the_mtbf():
    t = qwen8b_fp32()
    assert {plan(t, FailureModel(mtbf_hours=h)).snapshot_interval for h in (0.1, 1, 24, 1000)} == {4}


def test_keep_pace_interval_refuses_the_lag_regime():
    with pytest.raises(PolicyInputError, match="replay_step_seconds"):
        keep_pace_interval(qwen8b_bf16())


def test_replay_distance_and_recovery_by_hand():
    assert expected_replay_distance(4) == 3.0  # 1 + N/2
    assert expected_replay_distance(1) == 1.5
    t = qwen8b_fp32(restart_seconds=30.0)
    # software: restart 30 + load (= C_snap) 4 + 3 records * 6.59
    assert keep_pace_recovery_seconds(t, 4, "software") == pytest.approx(53.77)
    # host: the durable snapshot is T_per / T_gpu = 2.3121 steps later: 2 + 1 + 2.3121 records
    # replayed on the CPU, plus restart 30, storage read (= T_per) 20 and load 4
    assert keep_pace_recovery_seconds(t, 4, "host") == pytest.approx(54.0 + (3.0 + 20 / 8.65) * 6.59)


def test_lag_interval_by_hand():
    # x = sqrt(2 * 3600 * 2) / 3.68 = 32.61; J(32) = 120.0213 > J(33) = 120.0085
    assert lag_interval(qwen8b_bf16(), 3600.0) == 33


def test_lag_interval_respects_the_persistence_bound():
    t = Timings(gpu_step_seconds=1.0, replay_step_seconds=2.0, snapshot_cost_seconds=0.01, persist_seconds=40.0)
    assert lag_interval(t, 100.0) == 20


def test_lag_growth_and_resync_by_hand():
    t = qwen8b_bf16()
    rate = 1 / 2.85 - 1 / (3.68 + 2 / 33)  # 0.08354 steps per second
    assert lag_growth_steps_per_second(t, 33) == pytest.approx(rate)
    assert resync_interval_seconds(t, 33, 10.0) == pytest.approx(10.0 / rate)  # 119.7 s
    failures = FailureModel(mtbf_hours=1.0)
    assert optimal_lag_bound_steps(t, 33, failures) == pytest.approx(math.sqrt(2 * 3600 * rate * 2.0 / 3.68))
    assert lag_window_seconds(t, failures, 10.0) == pytest.approx(3600 * 2.0 / (10.0 * 3.68))
    assert should_resync(12.0, 10.0) and not should_resync(9.0, 10.0) and not should_resync(1e9, None)


def test_an_interval_below_the_pacing_bound_lags_and_gets_a_resync_bound():
    t = Timings(gpu_step_seconds=10.0, replay_step_seconds=9.0, snapshot_cost_seconds=3.5, persist_seconds=1.0)
    f = FailureModel(mtbf_hours=1.0)
    below = configure(t, f, "zocheck", snapshot_interval_steps=3)  # 9 + 3.5 / 3 > 10
    assert lag_growth_steps_per_second(t, 3) == pytest.approx(1 / 10 - 1 / (9 + 3.5 / 3))
    assert below.lag_bound_steps == pytest.approx(optimal_lag_bound_steps(t, 3, f))
    at = configure(t, f, "zocheck")
    assert at.snapshot_interval == 4 and at.lag_bound_steps is None
    assert expected_waste(t, f, at).waste_seconds < expected_waste(t, f, below).waste_seconds


def test_keep_pace_never_needs_a_resync():
    t = qwen8b_fp32()
    assert lag_growth_steps_per_second(t, 4) == 0.0
    assert resync_interval_seconds(t, 4, 10.0) is None
    assert optimal_lag_bound_steps(t, 4, FailureModel(mtbf_hours=1)) is None
    assert plan(t, FailureModel(mtbf_hours=1)).resync_interval_seconds is None


def test_young_daly_by_hand():
    assert young_daly_interval(20.0, 86400.0, 8.65) == 215  # sqrt(2 * 20 * 86400) / 8.65 = 214.9
    assert young_daly_interval(0.001, 100.0, 10.0) == 1


def test_lag_plan_without_mtbf_uses_the_persistence_bound():
    p = plan(qwen8b_bf16())
    assert p.snapshot_interval == 3  # ceil(10 / 3.68)
    assert p.lag_bound_steps is None and p.expected_recovery_seconds is None
    assert p.notes


def test_lag_plan_with_mtbf_sets_n_and_the_resync_bound():
    p = plan(qwen8b_bf16(), FailureModel(mtbf_hours=1.0))
    assert p.regime == "lag" and p.pacing_bound is None
    n, bound = p.snapshot_interval, p.lag_bound_steps
    assert n >= math.ceil(persistence_bound(qwen8b_bf16()))
    assert bound == pytest.approx(optimal_lag_bound_steps(qwen8b_bf16(), n, FailureModel(mtbf_hours=1.0)))
    assert p.resync_interval_seconds == pytest.approx(bound / lag_growth_steps_per_second(qwen8b_bf16(), n))
    # N is a local minimum of the exact expected waste (L re-optimised at each N)
    f = FailureModel(mtbf_hours=1.0)
    waste = {m: expected_waste(qwen8b_bf16(), f, configure(qwen8b_bf16(), f, "zocheck", snapshot_interval_steps=m))
             .waste_seconds for m in (n - 1, n, n + 1)}
    assert waste[n] <= waste[n - 1] and waste[n] <= waste[n + 1]
    assert p.waste["zocheck"].waste_seconds == pytest.approx(waste[n])


# --- expected waste, by hand ----------------------------------------------------------------------


def test_zocheck_keep_pace_waste_by_hand():
    t = qwen8b_fp32(restart_seconds=30.0, log_step_seconds=0.35)  # T_t = 9 s
    f = FailureModel(mtbf_hours=1.0)
    w = expected_waste(t, f, StrategyConfig(strategy="zocheck", snapshot_interval=4))
    assert w.overhead_seconds == pytest.approx(3600 * 0.35 / 9)  # 140 s of logging per window
    assert w.recovery_seconds == pytest.approx(53.77)
    assert w.waste_seconds == pytest.approx(193.77)
    assert w.waste_fraction == pytest.approx(193.77 / (3600 + 53.77))
    assert w.replay_distance_steps == 3.0


def test_sync_checkpoint_waste_by_hand():
    t = Timings(gpu_step_seconds=1.0, replay_step_seconds=0.5, snapshot_cost_seconds=0.5, persist_seconds=2.0,
                restart_seconds=5.0, storage_read_seconds=3.0)
    f = FailureModel(mtbf_hours=100 / 3600)  # M = 100 s
    w = expected_waste(t, f, ckpt("sync-checkpoint", 10))
    # P = 10 + 2; E[completed] = 1 / (e^0.12 - 1) = 7.8433; 100 - 78.433 + 5 + 3
    assert w.waste_seconds == pytest.approx(100 - 10 / math.expm1(0.12) + 8, rel=1e-12)
    assert w.waste_seconds == pytest.approx(29.567, abs=1e-3)
    assert w.overhead_seconds == pytest.approx(2 / math.expm1(0.12))


def test_async_checkpoint_waste_by_hand():
    t = Timings(gpu_step_seconds=1.0, replay_step_seconds=0.5, snapshot_cost_seconds=0.5, persist_seconds=2.0)
    f = FailureModel(mtbf_hours=100 / 3600)
    # staging 0.5 on the critical path, P = 10.5; durable 2 s later: e^-0.02 / (e^0.105 - 1)
    w = expected_waste(t, f, ckpt("async-checkpoint", 10))
    assert w.waste_seconds == pytest.approx(100 - 10 * math.exp(-0.02) / math.expm1(0.105) + 2.0, rel=1e-12)
    # a write (3 s) longer than K steps (1 s) stalls the next staging: P = 1 + 0.5 + 2
    slow = t.model_copy(update={"checkpoint_save_seconds": 3.0})
    w = expected_waste(slow, f, ckpt("async-checkpoint", 1))
    assert w.waste_seconds == pytest.approx(100 - math.exp(-0.03) / math.expm1(0.035) + 2.0, rel=1e-12)


def test_log_only_replays_half_the_run():
    t = qwen8b_fp32(storage_read_seconds=20.0)
    one_window = expected_waste(t, FailureModel(mtbf_hours=1.0), StrategyConfig(strategy="log-only"))
    assert one_window.replay_distance_steps == pytest.approx(1800 / 8.65)
    assert one_window.waste_seconds == pytest.approx(20 + 1800 / 8.65 * 6.59)  # 1391.3 s
    long_run = expected_waste(t, FailureModel(mtbf_hours=1.0, run_hours=10.0), StrategyConfig(strategy="log-only"))
    assert long_run.waste_seconds == pytest.approx(20 + 18000 / 8.65 * 6.59)


def test_checkpoint_forms_reduce_to_young_daly_first_order():
    t = Timings(gpu_step_seconds=1.0, replay_step_seconds=0.5, snapshot_cost_seconds=0.5, persist_seconds=2.0)
    f = FailureModel(mtbf_hours=1000.0)
    w = expected_waste(t, f, ckpt("sync-checkpoint", 100))
    first_order = f.mtbf_seconds * 2 / 102 + 100 / 2 + 2.0  # M C / P + K T / 2 + read
    assert w.waste_seconds == pytest.approx(first_order, rel=1e-3)


def test_lag_waste_matches_direct_integration_of_the_mechanics():
    t = qwen8b_bf16(restart_seconds=7.0, log_step_seconds=0.05)
    f = FailureModel(mtbf_hours=0.2)
    n, bound = 6, 9.0
    closed = expected_waste(t, f, StrategyConfig(strategy="zocheck", snapshot_interval=n, lag_bound_steps=bound))
    # the window's waste as a function of the failure time x, integrated on a fine grid
    m, t_t, t_eff = f.mtbf_seconds, 2.9, 3.68 + 2.0 / n
    rate = 1 / t_t - 1 / t_eff
    span = bound / rate
    period = span + 2.0
    x = (np.arange(1_000_000) + 0.5) * (40 * m / 1_000_000)
    cycles = np.floor(x / period)
    active = np.minimum(x - cycles * period, span)
    overhead = (cycles * span + active) * 0.05 / t_t + cycles * 2.0 + (x - cycles * period - active)
    distance = rate * active + np.mod(active / t_eff, n)
    waste = overhead + 7.0 + 2.0 + distance * 3.68 + 2.0
    integral = np.sum(waste * np.exp(-x / m)) * (40 * m / 1_000_000) / m
    assert closed.waste_seconds == pytest.approx(integral, rel=1e-4)


# --- properties ----------------------------------------------------------------------------------


@FAST
@given(gpu=seconds, replay=seconds, snap=seconds, persist=seconds)
def test_keep_pace_n_meets_both_bounds_and_is_minimal(gpu, replay, snap, persist):
    assume(replay < gpu)
    t = timings(gpu, replay, snap, persist)
    n = keep_pace_interval(t)
    assert n >= 1 and n >= pacing_bound(t) and n >= persistence_bound(t)
    assert n == 1 or n - 1 < pacing_bound(t) or n - 1 < persistence_bound(t)


@FAST
@given(gpu=seconds, replay=seconds, snap=seconds, persist=seconds)
def test_lag_is_detected_exactly_when_replay_is_not_faster_than_the_gpu(gpu, replay, snap, persist):
    t = timings(gpu, replay, snap, persist)
    assert (regime(t) == "lag") == (replay >= gpu)
    assert (pacing_bound(t) is None) == (replay >= gpu)
    assert (lag_growth_steps_per_second(t, snapshot_interval(t)) > 0) == (replay >= gpu)


@FAST
@given(gpu=seconds, replay=seconds, snap=seconds, persist=seconds, mtbf=st.floats(0.5, 1000.0))
@example(gpu=66.0, replay=66.0, snap=0.01, persist=67.0, mtbf=0.5)  # a resync period of 726 MTBFs: e^{P/M} overflowed
def test_policy_n_always_meets_the_persistence_bound(gpu, replay, snap, persist, mtbf):
    t = timings(gpu, replay, snap, persist)
    n = plan(t, FailureModel(mtbf_hours=mtbf)).snapshot_interval
    assert n >= 1 and n >= persistence_bound(t)


@FAST
@given(window=st.floats(10.0, 1e6), snap=seconds, replay=seconds)
def test_lag_interval_scales_as_the_square_root_of_the_window(window, snap, replay):
    t = Timings(gpu_step_seconds=replay / 2, replay_step_seconds=replay, snapshot_cost_seconds=snap,
                persist_seconds=1e-3)
    assume(math.sqrt(2 * window * snap) / replay >= 2)  # away from the floor of one step
    n, n4 = lag_interval(t, window), lag_interval(t, 4 * window)
    assert 2 * n - 2 <= n4 <= 2 * n + 2


@FAST
@given(t_step=seconds, mtbf=st.floats(0.5, 1000.0), n=st.integers(1, 200), restart=st.floats(0, 600))
def test_zocheck_keep_pace_waste_grows_with_n_and_restart_and_its_share_falls_with_mtbf(t_step, mtbf, n, restart):
    t = Timings(gpu_step_seconds=t_step, replay_step_seconds=t_step / 2, snapshot_cost_seconds=t_step,
                persist_seconds=t_step, restart_seconds=restart, log_step_seconds=t_step / 100)
    f = FailureModel(mtbf_hours=mtbf)
    n += keep_pace_interval(t) - 1  # at or above the pacing bound, where the shadow keeps pace
    at = lambda m, tt=t, ff=f: expected_waste(tt, ff, StrategyConfig(strategy="zocheck", snapshot_interval=m))
    assert at(n + 1).waste_seconds >= at(n).waste_seconds
    slower = t.model_copy(update={"restart_seconds": restart + 1})
    assert at(n, slower).waste_seconds > at(n).waste_seconds
    longer = FailureModel(mtbf_hours=2 * mtbf)
    assert at(n, t, longer).waste_fraction <= at(n).waste_fraction


@FAST
@given(t_step=seconds, save=seconds, mtbf=st.floats(0.5, 1000.0), k=st.integers(1, 500),
       strategy=st.sampled_from(["sync-checkpoint", "async-checkpoint"]))
def test_checkpoint_waste_grows_with_the_window_and_the_save_cost(t_step, save, mtbf, k, strategy):
    t = Timings(gpu_step_seconds=t_step, replay_step_seconds=t_step, snapshot_cost_seconds=save / 10,
                persist_seconds=save)
    waste = lambda tt, h: expected_waste(tt, FailureModel(mtbf_hours=h), ckpt(strategy, k)).waste_seconds
    assert waste(t, 2 * mtbf) >= waste(t, mtbf) * (1 - 1e-9)
    costlier = t.model_copy(update={"checkpoint_save_seconds": 2 * save})
    assert waste(costlier, mtbf) >= waste(t, mtbf) * (1 - 1e-9)


@FAST
@given(save=seconds, mtbf=st.floats(1.0, 1000.0), t_step=seconds)
def test_young_daly_interval_doubles_when_the_mtbf_quadruples(save, mtbf, t_step):
    k = young_daly_interval(save, mtbf * 3600, t_step)
    assume(k >= 2)
    assert 2 * k - 1 <= young_daly_interval(save, 4 * mtbf * 3600, t_step) <= 2 * k + 1


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["gpu_step_seconds", "replay_step_seconds", "snapshot_cost_seconds",
                                   "persist_seconds"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_non_positive_or_non_finite_times_are_rejected_by_name(field, value):
    values = dict(gpu_step_seconds=1.0, replay_step_seconds=1.0, snapshot_cost_seconds=1.0, persist_seconds=1.0)
    values[field] = value
    with pytest.raises(ValidationError, match=field):
        Timings(**values)


@pytest.mark.parametrize("field", ["restart_seconds", "load_seconds", "log_step_seconds",
                                   "checkpoint_save_seconds"])
def test_negative_or_nan_optional_costs_are_rejected_by_name(field):
    for value in (-0.5, math.nan):
        with pytest.raises(ValidationError, match=field):
            qwen8b_fp32(**{field: value})


def test_unknown_fields_are_rejected():
    with pytest.raises(ValidationError, match="gpu_step"):
        Timings(gpu_step=1.0, replay_step_seconds=1.0, snapshot_cost_seconds=1.0, persist_seconds=1.0)


@pytest.mark.parametrize("value", [0.0, -2.0, math.nan])
def test_a_bad_mtbf_is_rejected_by_name(value):
    with pytest.raises(ValidationError, match="mtbf_hours"):
        FailureModel(mtbf_hours=value)


def test_an_mtbf_shorter_than_a_step_is_rejected_by_name():
    t = Timings(gpu_step_seconds=30.0, replay_step_seconds=1.0, snapshot_cost_seconds=1.0, persist_seconds=1.0)
    with pytest.raises(PolicyInputError, match="mtbf_hours") as error:
        plan(t, FailureModel(mtbf_hours=0.005))  # 18 s < 30 s
    assert error.value.field == "mtbf_hours"
    with pytest.raises(PolicyInputError, match="mtbf_hours"):
        expected_waste(t, FailureModel(mtbf_hours=0.005), StrategyConfig(strategy="log-only"))


def test_bad_policy_parameters_are_rejected_by_name():
    t, f = qwen8b_bf16(), FailureModel(mtbf_hours=1)
    with pytest.raises(PolicyInputError, match="lag_bound_steps"):
        plan(qwen8b_fp32(), f, lag_bound_steps=-3.0)
    with pytest.raises(PolicyInputError, match="checkpoint_interval_steps"):
        configure(t, f, "sync-checkpoint", checkpoint_interval_steps=0)
    with pytest.raises(PolicyInputError, match="snapshot_interval"):
        expected_replay_distance(0)
    with pytest.raises(PolicyInputError, match="lag_bound_steps"):
        expected_waste(t, f, StrategyConfig(strategy="zocheck", snapshot_interval=5))
    with pytest.raises(PolicyInputError, match="window_seconds"):
        lag_interval(t, math.nan)


def test_durable_snapshots_are_spaced_so_their_writes_take_at_most_the_storage_share():
    # A shadow that keeps pace snapshots every N = 40 steps; writing the state takes 20 s, a step 1 s.
    t = Timings(gpu_step_seconds=1.0, replay_step_seconds=0.5, snapshot_cost_seconds=0.1, persist_seconds=20.0)
    n = keep_pace_interval(t)
    d = durable_interval(t, n, storage_share=0.1)
    assert d % n == 0
    assert d * t.trainer_step >= t.persist_seconds / 0.1 > (d - n) * t.trainer_step  # the smallest such multiple
    assert plan(t).durable_interval == d and plan(t).storage_share == 0.1
    assert plan(t, storage_share=1.0).durable_interval == durable_interval(t, n, 1.0) < d
    fast = Timings(gpu_step_seconds=1.0, replay_step_seconds=0.5, snapshot_cost_seconds=0.1, persist_seconds=0.01)
    assert durable_interval(fast, keep_pace_interval(fast)) == keep_pace_interval(fast)  # every snapshot
    for share in (0.0, 1.5, float("nan")):
        with pytest.raises(PolicyInputError, match="storage_share"):
            durable_interval(t, n, share)
