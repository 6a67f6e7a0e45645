"""The Monte-Carlo simulator, the startup profile and the `plan` / `simulate` commands."""

from __future__ import annotations

import argparse
import doctest
import json
import time

import matplotlib.image
import pytest

import zocheck_ray.policies as policies
from zocheck_ray.policies import (
    STRATEGIES,
    FailureModel,
    KnownTimings,
    PolicyInputError,
    ProfileSettings,
    StrategyConfig,
    Timings,
    configure,
    expected_waste,
    profile_startup,
    simulate_waste,
)
from zocheck_ray.policies import cli as policies_cli

KEEP_PACE = Timings(gpu_step_seconds=8.65, replay_step_seconds=6.59, snapshot_cost_seconds=4.0,
                    persist_seconds=20.0, restart_seconds=30.0, log_step_seconds=0.01)
LAG = Timings(gpu_step_seconds=2.85, replay_step_seconds=3.68, snapshot_cost_seconds=2.0,
              persist_seconds=10.0, restart_seconds=30.0, log_step_seconds=0.01)


# --- simulator -----------------------------------------------------------------------------------


@pytest.mark.parametrize("timings", [KEEP_PACE, LAG], ids=["keep-pace", "lag"])
@pytest.mark.parametrize("kind", ["software", "host"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mtbf_hours", [0.05, 4.0])
def test_simulation_agrees_with_the_closed_form(timings, kind, strategy, mtbf_hours):
    failures = FailureModel(mtbf_hours=mtbf_hours, failure_kind=kind)
    config = configure(timings, failures, strategy)
    closed = expected_waste(timings, failures, config)
    result = simulate_waste(timings, failures, config, trials=50_000, seed=7, confidence=0.99)
    assert result.ci_low_seconds <= closed.waste_seconds <= result.ci_high_seconds
    assert result.waste_fraction == pytest.approx(closed.waste_fraction, rel=0.05)


def test_a_short_resync_bound_agrees_too():
    failures = FailureModel(mtbf_hours=0.3)
    config = StrategyConfig(strategy="zocheck", snapshot_interval=4, lag_bound_steps=3.0)
    closed = expected_waste(LAG, failures, config)
    result = simulate_waste(LAG, failures, config, trials=50_000, seed=3, confidence=0.99)
    assert result.ci_low_seconds <= closed.waste_seconds <= result.ci_high_seconds


def test_the_seed_fixes_the_result_and_the_interval_narrows_with_trials():
    failures = FailureModel(mtbf_hours=2.0)
    config = configure(KEEP_PACE, failures, "sync-checkpoint")
    a = simulate_waste(KEEP_PACE, failures, config, trials=2_000, seed=11)
    assert a == simulate_waste(KEEP_PACE, failures, config, trials=2_000, seed=11)
    assert a.mean_seconds != simulate_waste(KEEP_PACE, failures, config, trials=2_000, seed=12).mean_seconds
    wide = a.ci_high_seconds - a.ci_low_seconds
    b = simulate_waste(KEEP_PACE, failures, config, trials=32_000, seed=11)
    assert b.ci_high_seconds - b.ci_low_seconds == pytest.approx(wide / 4, rel=0.15)


def test_zocheck_wastes_least_in_keep_pace():
    failures = FailureModel(mtbf_hours=24.0)
    means = {s: simulate_waste(KEEP_PACE, failures, configure(KEEP_PACE, failures, s), trials=5_000, seed=0)
             .mean_seconds for s in STRATEGIES}
    assert min(means, key=means.get) == "zocheck"
    assert means["log-only"] > means["sync-checkpoint"] > means["async-checkpoint"] > means["zocheck"]


def test_simulator_bad_input_names_the_argument():
    failures = FailureModel(mtbf_hours=1.0)
    config = configure(KEEP_PACE, failures, "zocheck")
    with pytest.raises(PolicyInputError, match="trials"):
        simulate_waste(KEEP_PACE, failures, config, trials=1)
    with pytest.raises(PolicyInputError, match="confidence"):
        simulate_waste(KEEP_PACE, failures, config, confidence=1.5)
    with pytest.raises(PolicyInputError, match="mtbf_hours"):
        simulate_waste(KEEP_PACE, FailureModel(mtbf_hours=0.001), config)
    with pytest.raises(PolicyInputError, match="checkpoint_interval_steps"):
        simulate_waste(KEEP_PACE, failures, StrategyConfig(strategy="sync-checkpoint"))


# --- startup profile -----------------------------------------------------------------------------


def test_profile_with_self_reported_times_plans_exactly():
    calls = {"trainer": 0, "replay": []}

    def trainer_step(i):
        calls["trainer"] += 1
        return 8.65

    def replay_step(record, threads):
        calls["replay"].append((record, threads))
        return {1: 20.0, 2: 10.0, 4: 6.59, 8: 7.5}[threads]

    report = profile_startup(trainer_step=trainer_step, replay_step=replay_step,
                             snapshot_copy=lambda: 4.0, persist=lambda: 20.0,
                             extra_timings={"restart_seconds": 30.0})
    assert report.replay_threads == 4
    assert report.replay_seconds_by_threads == {1: 20.0, 2: 10.0, 4: 6.59, 8: 7.5}
    assert report.timings == KEEP_PACE.model_copy(update={"log_step_seconds": 0.0})
    assert report.snapshot_interval == 4 and report.plan.regime == "keep-pace"
    assert report.plan.replay_threads == 4
    # 4 thread counts x (1 untimed + 2 timed) replays need 12 records, so 12 trainer steps
    assert report.training_steps == calls["trainer"] == 12
    assert [r for r, _ in calls["replay"]] == list(range(12))  # records replayed in order
    assert report.gpu_step_samples == [8.65] * 10  # two warm-up steps left out
    assert report.measured == ["gpu_step_seconds", "replay_step_seconds", "snapshot_cost_seconds",
                               "persist_seconds"]


def test_profile_times_each_call_by_its_clock_and_picks_the_fastest_thread_count():
    # A clock that moves only when the calls spend time: the measurements are exact on any machine
    # (every duration a multiple of 2**-10 s, so the differences of the clock's readings are exact).
    now = [0.0]

    def spend(seconds: float) -> None:  # returns None: the profile times the call itself
        now[0] += seconds

    unit = 2.0**-10
    replay_cost = {1: 60 * unit, 2: 36 * unit, 4: 10 * unit, 8: 30 * unit}
    report = profile_startup(
        trainer_step=lambda i: spend(12 * unit),
        replay_step=lambda record, threads: spend(replay_cost[threads]),
        snapshot_copy=lambda: spend(4 * unit),
        persist=lambda: spend(8 * unit),
        failures=FailureModel(mtbf_hours=1.0),
        clock=lambda: now[0],
    )
    assert report.replay_threads == 4
    assert report.replay_seconds_by_threads == replay_cost
    assert report.gpu_step_samples == [12 * unit] * 10  # two warm-up steps left out
    assert report.timings.gpu_step_seconds == 12 * unit
    assert report.timings.replay_step_seconds == 10 * unit
    assert report.timings.snapshot_cost_seconds == 4 * unit
    assert report.timings.persist_seconds == 8 * unit
    assert report.profile_seconds == now[0]  # every call, timed or not, and nothing else
    assert report.plan.regime == "keep-pace"  # replay 10 < trainer 12
    assert report.snapshot_interval == report.plan.snapshot_interval == 2  # >= 4 / (12 - 10) and >= 8 / 10
    assert set(report.plan.waste) == set(STRATEGIES)
    assert report.training_steps == 12  # 4 thread counts x (1 + 2) replays


def test_profile_times_with_the_wall_clock_by_default():
    report = profile_startup(
        trainer_step=lambda i: time.sleep(0.012), replay_step=lambda record, threads: time.sleep(0.010),
        snapshot_copy=lambda: time.sleep(0.004), persist=lambda: time.sleep(0.008),
        settings=ProfileSettings(thread_counts=(1,)),
    )
    # a sleep lasts at least as long as asked (how much longer depends on the machine's load)
    assert report.timings.gpu_step_seconds >= 0.012
    assert report.timings.replay_step_seconds >= 0.010
    assert report.timings.snapshot_cost_seconds >= 0.004
    assert report.timings.persist_seconds >= 0.008


def test_profile_in_the_lag_regime_sets_the_resync_bound():
    report = profile_startup(trainer_step=lambda i: 2.85, replay_step=lambda r, p: 3.68,
                             snapshot_copy=lambda: 2.0, persist=lambda: 10.0,
                             settings=ProfileSettings(thread_counts=(4,)), failures=FailureModel(mtbf_hours=1.0))
    assert report.plan.regime == "lag"
    assert report.plan.lag_bound_steps > 0 and report.plan.resync_interval_seconds > 0
    assert report.training_steps == 7  # 2 warm-up + 5 timed; 3 replays fit in those


def test_profile_uses_known_numbers_without_measuring():
    report = profile_startup(known=KnownTimings(gpu_step_seconds=8.65, replay_step_seconds=6.59, replay_threads=6,
                                                snapshot_cost_seconds=4.0, persist_seconds=20.0))
    assert report.training_steps == 0 and report.measured == []
    assert report.replay_threads == 6 and report.snapshot_interval == 4


def test_the_default_profile_fits_in_thirty_training_steps():
    steps = []
    profile_startup(trainer_step=steps.append, replay_step=lambda r, p: 0.5, snapshot_copy=lambda: 0.1,
                    persist=lambda: 0.1, settings=ProfileSettings(thread_counts=(1, 2, 3, 4, 6, 8, 12, 16)))
    assert len(steps) == 24 <= 30


def test_profile_bad_input_names_what_to_fix():
    with pytest.raises(PolicyInputError, match="thread_counts") as error:
        profile_startup(trainer_step=lambda i: 1.0, replay_step=lambda r, p: 1.0, snapshot_copy=lambda: 1.0,
                        persist=lambda: 1.0, settings=ProfileSettings(thread_counts=tuple(range(1, 12))))
    assert "max_training_steps=30" in str(error.value)
    with pytest.raises(PolicyInputError, match="replay_step"):
        profile_startup(trainer_step=lambda i: 1.0, replay_step=lambda r, p: -2.0, snapshot_copy=lambda: 1.0,
                        persist=lambda: 1.0)
    with pytest.raises(PolicyInputError, match="snapshot_copy"):
        profile_startup(trainer_step=lambda i: 1.0, replay_step=lambda r, p: 1.0, persist=lambda: 1.0)
    with pytest.raises(PolicyInputError, match="trainer_step"):
        profile_startup(trainer_step=lambda i: "fast", replay_step=lambda r, p: 1.0, snapshot_copy=lambda: 1.0,
                        persist=lambda: 1.0)
    with pytest.raises(ValueError, match="thread_counts"):
        ProfileSettings(thread_counts=(2, 2))


# --- command line ----------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="zocheck-ray")
    policies_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


TIMING_ARGS = ["--gpu-step", "8.65", "--replay-step", "6.59", "--snapshot-cost", "4", "--persist-time", "20"]


def test_cli_lists_the_policies_module():
    import zocheck_ray.cli

    assert "zocheck_ray.policies.cli" in zocheck_ray.cli.COMMAND_MODULES


def test_plan_writes_json_with_the_bounds_regime_and_interval(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert run_cli(["plan", *TIMING_ARGS, "--mtbf-hours", "24", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["pacing_bound"] == pytest.approx(4 / 2.06)
    assert result["persistence_bound"] == pytest.approx(20 / 6.59)
    assert result["regime"] == "keep-pace"
    assert result["snapshot_interval"] == 4
    assert result["waste"]["zocheck"]["waste_seconds"] == pytest.approx(4 + 3 * 6.59)
    assert result["waste"]["sync-checkpoint"]["config"]["checkpoint_interval_steps"] == 215
    printed = capsys.readouterr().out
    assert "keep-pace" in printed and "snapshot interval N" in printed and "async-checkpoint" in printed


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_json_path_that_cannot_be_written_is_refused_before_the_work(tmp_path, capsys, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = [command, *TIMING_ARGS, "--mtbf-hours", "24", "--json", str(blocker / "out.json")]
    assert run_cli(argv) == 2
    err = capsys.readouterr()
    assert "--json" in err.err and "not an existing directory" in err.err and err.out == ""  # no work printed


def test_plan_in_the_lag_regime(tmp_path):
    out = tmp_path / "plan.json"
    argv = ["plan", "--gpu-step", "2.85", "--replay-step", "3.68", "--snapshot-cost", "2", "--persist-time", "10"]
    assert run_cli([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["regime"] == "lag" and result["pacing_bound"] is None and result["snapshot_interval"] == 3


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--gpu-step", "-1"], "--gpu-step"),
        (["--replay-step", "nan"], "--replay-step"),
        (["--snapshot-cost", "0"], "--snapshot-cost"),
        (["--mtbf-hours", "0.0001"], "--mtbf-hours"),
        (["--mtbf-hours", "1", "--lag-bound", "-3"], "--lag-bound"),
    ],
)
def test_plan_bad_input_names_the_flag(args, flag, capsys):
    values = dict(zip(TIMING_ARGS[::2], TIMING_ARGS[1::2]))
    extra = []
    for name, value in zip(args[::2], args[1::2]):
        if name in values:
            values[name] = value
        else:
            extra += [name, value]
    argv = ["plan", *[item for pair in values.items() for item in pair], *extra]
    assert run_cli(argv) == 2
    assert f"error: {flag}:" in capsys.readouterr().err


def test_simulate_writes_a_png_and_json(tmp_path, capsys):
    png, out = tmp_path / "waste.png", tmp_path / "waste.json"
    argv = ["simulate", *TIMING_ARGS, "--restart", "30", "--mtbf-range", "1", "100", "--points", "3",
            "--trials", "2000", "--seed", "5", "--plot", str(png), "--json", str(out)]
    assert run_cli(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 300 and image.shape[1] > 800
    rows = json.loads(out.read_text())["rows"]
    assert [r["mtbf_hours"] for r in rows[::4]] == pytest.approx([1.0, 10.0, 100.0])
    assert [r["strategy"] for r in rows[:4]] == list(STRATEGIES)
    for row in rows:
        sim = row["simulated"]
        assert sim["trials"] == 2000 and sim["seed"] == 5
        assert sim["ci_low_seconds"] < sim["mean_seconds"] < sim["ci_high_seconds"]
    printed = capsys.readouterr().out
    assert "closed form" in printed and "log-only" in printed


def test_simulate_prints_and_writes_json_without_matplotlib(tmp_path, capsys, no_matplotlib):
    out = tmp_path / "waste.json"
    argv = ["simulate", *TIMING_ARGS, "--mtbf-hours", "2", "--strategies", "zocheck", "--trials", "500",
            "--json", str(out)]
    assert run_cli(argv) == 0
    assert [r["strategy"] for r in json.loads(out.read_text())["rows"]] == ["zocheck"]
    assert "closed form" in capsys.readouterr().out


def test_simulate_plot_without_matplotlib_says_how_to_get_it_before_simulating(tmp_path, capsys, no_matplotlib):
    png, out = tmp_path / "waste.png", tmp_path / "waste.json"
    argv = ["simulate", *TIMING_ARGS, "--mtbf-hours", "2", "--trials", "500", "--plot", str(png), "--json", str(out)]
    assert run_cli(argv) == 2
    captured = capsys.readouterr()
    assert "--plot" in captured.err and "matplotlib" in captured.err and "zocheck-ray[bench]" in captured.err
    assert "closed form" not in captured.out  # refused before any work
    assert not png.exists() and not out.exists()


def test_simulate_selected_strategies_and_values(capsys):
    argv = ["simulate", *TIMING_ARGS, "--mtbf-hours", "2", "8", "--strategies", "zocheck", "--trials", "500"]
    assert run_cli(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "zocheck" in line]
    assert len(lines) == 2


def test_simulate_bad_range_names_the_flag(capsys):
    argv = ["simulate", *TIMING_ARGS, "--mtbf-range", "10", "1", "--trials", "100"]
    assert run_cli(argv) == 2
    assert "error: --mtbf-range:" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["cost_model", "waste", "planner", "simulator", "profile"])
def test_docstring_examples_run(module):
    result = doctest.testmod(getattr(policies, module))
    assert result.attempted > 0 and result.failed == 0
