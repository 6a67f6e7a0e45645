"""`bench overhead` and `bench recovery` at a tiny scale, on one real local Ray instance.

These check what the benchmarks measure and write, not how fast this machine is:
the only comparisons are between figures measured in the same run, orders of
magnitude apart (a deque append against a Ray round trip).
"""

import argparse
import json

import pytest

from benchmarks import overhead as overhead_module
from benchmarks import recovery as recovery_module
from benchmarks.baselines import AsyncCheckpointTrainer, Strategy
from benchmarks.common import bench_job
from benchmarks.overhead import overhead_benchmark, parse_count, percentile
from benchmarks.failures import catch_up_seconds
from benchmarks.recovery import Scenario, check_targets, failure_steps, recovery_benchmark
from benchmarks.recovery_comparison import ComparisonSpec

# the overhead and recovery benchmarks on the local Ray instance (conftest.local_ray: slow by that fixture)
pytestmark = pytest.mark.usefixtures("local_ray")


@pytest.fixture(scope="module")
def overhead(tmp_path_factory):
    path = tmp_path_factory.mktemp("overhead") / "overhead.json"
    doc = overhead_benchmark([20_000, 300_000], storage=str(path.parent), trainer_steps=40, json_path=str(path),
                             say=lambda line: None, strategy_steps=15, intervals=(3, 7), min_steps=3, max_steps=30,
                             step_budget_seconds=1.0, loop_records=2000, ray_calls=50)
    return doc, path


@pytest.fixture(scope="module")
def recovery(tmp_path_factory):
    path = tmp_path_factory.mktemp("recovery") / "recovery.json"
    early = failure_steps(5, 1, spacing=3)
    late = failure_steps(16, 1, spacing=3, align_to=early[0])
    scenario = Scenario("depth", "tiny-opt", 23_360, {"early": early, "late": late}, baseline_points=("early",))
    comparison = ComparisonSpec("comparison", "tiny-opt", 23_360, 9,
                                (Strategy("log-only"), Strategy("zocheck")),
                                modes=("software",), nominal_steps=12)  # host failures: test_ray_host_failure
    # (a checkpointing strategy's restart from its newest checkpoint: test_bench_strategies, without Ray)
    # (an async checkpoint's recovery on Ray: the depth scenario's baseline, async K=7)
    doc = recovery_benchmark([scenario], storage=str(path.parent), snapshot_interval=4, log_interval=3,
                             json_path=str(path), say=lambda line: None, comparisons=[comparison])
    return doc, path


def test_overhead_writes_one_row_per_size_with_the_documented_keys(overhead):
    doc, path = overhead
    assert json.loads(path.read_text()) == doc
    assert doc["benchmark"] == "overhead" and doc["machine"]["cpu_count"] >= 1
    assert [r["params"] for r in doc["results"]] == [20_000, 300_000]
    for key in ("publish_median_below_target", "flat", "met", "worst_publish_us_median", "growth_us", "spread_us",
                "notes"):
        assert key in doc["targets"]
    for row in doc["results"]:
        assert row["dtype"] == "fp32" and 3 <= row["steps"] <= 30
        assert row["loop_records"] == 2000
        for key in ("publish_us_median", "publish_us_p99", "publish_loop_us_median", "ray_call_us_median",
                    "ray_submit_us_median", "staging_copy_ms", "sync_save_ms", "zo_step_ms"):
            assert row[key] > 0, key
        assert row["publish_us_median"] <= row["publish_us_p99"]


def test_publishing_costs_less_than_a_ray_call_and_a_synchronous_save(overhead):
    for row in overhead[0]["results"]:
        assert row["publish_us_median"] < row["ray_call_us_median"]
        assert row["publish_loop_us_median"] < row["ray_call_us_median"]
        assert row["publish_us_median"] < row["sync_save_ms"] * 1e3


def test_every_published_record_reaches_the_sink(overhead):
    for row in overhead[0]["results"]:
        assert row["records_delivered_bytes"] == row["records_published_bytes"] > 0


def test_the_real_trainer_row_reports_its_own_publish_median(overhead):
    trainer = overhead[0]["trainer"]
    assert trainer["steps"] == 40 and trainer["shadow_equals_trainer"]
    assert 0 < trainer["publish_us_median"] < overhead[0]["results"][0]["ray_call_us_median"]


def test_recovery_reports_both_systems_at_both_points(recovery):
    doc, path = recovery
    assert json.loads(path.read_text()) == doc
    (scenario,) = doc["scenarios"]
    assert scenario["failures"] == [6, 27]
    assert [p["point"] for p in scenario["points"]] == ["early", "late"]
    early, late = scenario["points"]
    assert early["zocheck_seconds"] > 0 and early["baseline_seconds"] > 0
    assert early["zocheck_over_baseline"] == pytest.approx(early["zocheck_seconds"] / early["baseline_seconds"])
    assert late["zocheck_seconds"] > 0 and late["baseline_seconds"] is None  # the baseline ran to the early point
    assert set(scenario["late_over_early"]) == {"zocheck", "zocheck_process"}
    assert set(doc["targets"]) == {"independent_of_depth", "faster_than_async_checkpoint", "comparison", "met",
                                   "notes"}


def test_zocheck_recoveries_come_from_the_shadow_image_and_catch_up_to_the_failed_step(recovery):
    recoveries = recovery[0]["scenarios"][0]["zocheck"]["recoveries"]
    assert [r["failed_at_step"] for r in recoveries] == [6, 27]
    for r in recoveries:
        assert r["image_source"] == "memory"
        assert r["recovered_step"] == r["image_step"] + r["replayed_records"] <= r["failed_at_step"]
        assert r["catch_up_measured"] or r["lost_steps"] > 3  # more unsent records than a segment holds
        assert r["seconds_to_failure_step"] == pytest.approx(r["seconds"] + r["catch_up_seconds"])
        # The restarted trainer's own account. It is not bounded by `seconds`: Ray restarts the
        # actor as soon as the process dies, which can be before the driver notices the death.
        assert r["constructor_seconds"] > 0
        assert r["process_seconds"] == pytest.approx(r["constructor_seconds"] + r["catch_up_seconds"])


def test_the_baseline_replays_its_log_from_its_newest_persisted_checkpoint(recovery):
    baseline = recovery[0]["scenarios"][0]["baseline"]
    assert baseline["every"] == 7 and baseline["kind"] == "async"
    for r in baseline["recoveries"]:
        assert r["checkpoint_step"] % 7 == 0 and r["checkpoint_step"] <= r["failed_at_step"]
        assert r["checkpoint_step"] + r["replayed_records"] + r["recomputed_steps"] == r["failed_at_step"]
        assert r["state_step"] == r["failed_at_step"]
        # `seconds` starts when the driver sees the failure, which Ray's restart may precede: only the restarted
        # process's own times are ordered against each other
        assert r["seconds"] > 0 and r["constructor_seconds"] > r["restore_seconds"] >= r["load_seconds"] >= 0
        assert r["process_seconds"] == pytest.approx(r["constructor_seconds"] + r["catch_up_seconds"])


def test_the_recovered_trainer_and_its_shadow_end_in_the_same_state_bit_for_bit(recovery):
    scenario = recovery[0]["scenarios"][0]
    assert scenario["zocheck"]["final_state_hash"] == scenario["zocheck"]["shadow_state_hash"]
    assert scenario["final_states_equal"] is None  # the baseline stopped after the early point


def test_the_baseline_without_ray_checkpoints_every_k_steps_and_reloads_the_newest(tmp_path):
    job = bench_job(model="tiny-opt", steps=20, storage=str(tmp_path))
    first = AsyncCheckpointTrainer(job, str(tmp_path / "ckpt"), every=3)
    first.run(10)
    first.close()
    again = AsyncCheckpointTrainer(job, str(tmp_path / "ckpt"), every=3)
    assert again.recovery["source"] == "checkpoint" and again.recovery["image_step"] == 9
    assert again.recovery["replayed_records"] == 1 and again.step == 10
    assert again.state_hash() == first.state_hash()
    again.close()


def test_failures_end_segments_and_late_ones_share_the_early_ones_checkpoint_phase():
    early = failure_steps(95, 3)
    late = failure_steps(10_000, 3, align_to=early[0])
    assert early == [100, 110, 120]
    assert all(s % 10 == 0 for s in late) and late[0] >= 10_000
    assert [s % 7 for s in late] == [s % 7 for s in early]


def test_targets_are_checked_only_where_the_baseline_was_run():
    zocheck = [{"failed_at_step": 100, "seconds_to_failure_step": 4.0, "catch_up_seconds": 0.1},
               {"failed_at_step": 10_040, "seconds_to_failure_step": 4.4, "catch_up_seconds": 0.1}]
    baseline = [{"failed_at_step": 100, "seconds": 5.0, "load_seconds": 0.1, "recompute_seconds": 1.0,
                 "replayed_records": 2}]
    points = [{"point": "early", "failure_steps": [100], "zocheck_seconds": 4.0, "baseline_seconds": 5.0,
               "zocheck_over_baseline": 0.8, "zocheck_replayed_records": 3, "baseline_recomputed_steps": 2},
              {"point": "late", "failure_steps": [10_040], "zocheck_seconds": 4.4, "baseline_seconds": None,
               "zocheck_over_baseline": None, "zocheck_replayed_records": 3, "baseline_recomputed_steps": None}]
    scenario = {"name": "depth", "points": points, "late_over_early": {"zocheck": 1.1},
                "zocheck": {"recoveries": zocheck}, "baseline": {"recoveries": baseline}}
    targets = check_targets([scenario])
    assert targets["met"] and targets["notes"] == []
    points[0]["zocheck_over_baseline"], scenario["late_over_early"]["zocheck"] = 1.25, 1.3
    targets = check_targets([scenario])
    assert not targets["independent_of_depth"]["met"] and not targets["faster_than_async_checkpoint"]["met"]
    assert len(targets["notes"]) == 2 and targets["notes"][0].startswith("depth: late/early = 1.30")


def test_catch_up_is_timed_from_the_recovery_line_to_the_segment_at_the_failed_step():
    events = [(1.0, "  trainer lost at step 30 (software); recovered at step 29 from memory image in 4.00 s"),
              (1.5, "  step    30  loss 4.8000  lag   0  snapshot 24  durable 24"),
              (2.0, "  trainer lost at step 40 (software); recovered at step 40 from memory image in 4.00 s")]
    assert catch_up_seconds(events) == {30: 0.5, 40: 0.0}


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    bench = parser.add_subparsers(dest="bench")
    for module in (overhead_module, recovery_module):
        module.register(bench)
    return parser


def test_helpers_and_the_command_line():
    assert parse_count("1M") == 1_000_000 and parse_count("2.5B") == 2_500_000_000 and parse_count("123") == 123
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    args = bench_parser().parse_args(["overhead", "--params", "1M", "10M", "--json", "o.json", "--intervals", "7"])
    assert args.params == [1_000_000, 10_000_000] and args.json == "o.json" and args.intervals == [7]
    assert args.strategy_steps == 2100
    args = bench_parser().parse_args(["recovery", "--late-step", "500", "--big-hidden", "0", "--modes", "host"])
    assert args.late_step == 500 and args.big_hidden == 0 and args.modes == ["host"]
    assert args.steps == 5000 and args.intervals == [7, 300, 1000] and args.large_hidden == 512


def test_overhead_compares_every_strategy_on_one_failure_free_run(overhead):
    strategies = overhead[0]["strategies"]
    names = [r["strategy"] for r in strategies["rows"]]
    assert names == ["log-only", "sync K=3", "sync K=7", "async K=3", "async K=7", "zocheck"]
    assert strategies["final_states_equal"]  # every strategy trained the same bits
    for r in strategies["rows"]:
        assert r["steps"] == 15
        assert r["checkpoints"] == (15 // r["every"] if r["every"] else 0)
        assert r["cumulative_seconds"] == pytest.approx(r["publish_seconds"] + r["checkpoint_seconds"])
        if r["kind"] in ("log-only", "zocheck"):
            assert r["checkpoint_seconds"] == 0 and r["checkpoints_persisted"] == 0
        else:
            assert r["checkpoints_persisted"] == r["checkpoints"]
    assert set(strategies["lowest"]["by_k"]) == {"3", "7"}
    targets = overhead[0]["targets"]
    assert targets["lowest_at_every_k"] == strategies["lowest"]["met"]
    assert overhead[0]["size_ratio"]["sizes"] == []  # no size of 100M parameters or more was measured


def test_the_comparison_recovers_every_strategy_to_the_uninterrupted_state(recovery):
    comparison = recovery[0]["comparisons"]["comparison"]
    assert comparison["failure_step"] == 9 and comparison["reference_state_hash"]
    rows = comparison["rows"]
    assert {(r["strategy"], r["mode"]) for r in rows} == {(s, "software") for s in ("log-only", "zocheck")}
    for r in rows:
        assert r["state_equal"] is True, (r["strategy"], r["mode"])
        assert not r["extrapolated"]
        assert r["image_step"] + r["replayed_records"] + r["recomputed_steps"] == r["failed_at_step"] == 9
        assert r["replayed_steps"] == 9 - r["image_step"]
        assert r["work_seconds"] == pytest.approx(r["restore_seconds"] + r["catch_up_seconds"])
        # `seconds` (the driver's) may start after Ray already restarted the process: not ordered against it
        assert r["seconds"] > 0 and r["process_seconds"] >= r["work_seconds"] > 0
        parts = r["breakdown"]  # fetch, install, replay, hash: the restore, part by part
        assert set(parts) == {"fetch_seconds", "install_seconds", "replay_seconds", "hash_seconds"}
        assert sum(parts.values()) == pytest.approx(r["restore_seconds"], abs=0.01), (r["strategy"], r["mode"])
    by = {(r["strategy"], r["mode"]): r for r in rows}
    assert by[("log-only", "software")]["image_step"] == 0  # replays every record from the start
    assert by[("zocheck", "software")]["image_source"] == "memory"


def test_the_comparison_targets_are_reported_with_reasons(recovery):
    targets = recovery[0]["targets"]["comparison"]
    assert targets["states_equal"]
    ratios = targets["over_log_only"]["ratios"]["comparison"]
    assert ratios["applicable"] is False and not targets["over_log_only"]["met"]  # 23K parameters, step 9
    assert ratios["restore"] > 0 and ratios["work"] > 0 and ratios["total"] > 0
    assert any("async K=7 was not run" in n for n in targets["notes"])
