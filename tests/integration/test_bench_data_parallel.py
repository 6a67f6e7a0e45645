"""`zocheck-ray bench data-parallel` on a real Ray instance: k=1 and k=2 runs paired by round,
steps per second timed between the warm-up and the failure, the recovery's phases reported."""

import json
from statistics import median

import pytest

from benchmarks.data_parallel import data_parallel_benchmark, markdown, round_order
from benchmarks.elastic import elastic_benchmark


RAY_CPUS = 4
"""Logical CPUs the local Ray instance has at least (`conftest.local_ray`: a k=1 and a k=2 run, each losing a rank)."""
pytestmark = pytest.mark.usefixtures("local_ray")


def test_rounds_alternate_which_run_goes_first():
    assert [round_order(i) for i in range(4)] == [(1, 2), (2, 1), (1, 2), (2, 1)]


def test_a_failure_too_early_to_time_steps_before_it_is_refused_before_any_run():
    with pytest.raises(ValueError, match="fail_at=20 must lie in"):
        data_parallel_benchmark(steps=50, fail_at=20)
    with pytest.raises(ValueError, match="rounds=0"):
        data_parallel_benchmark(steps=50, fail_at=40, rounds=0)
    with pytest.raises(ValueError, match="fail_at=5 must lie in"):  # the elastic benchmark's too
        elastic_benchmark(steps=20, fail_at=5)
    with pytest.raises(ValueError, match="rounds=0"):
        elastic_benchmark(steps=20, fail_at=12, rounds=0)


def test_the_benchmark_pairs_k1_and_k2_side_by_side(tmp_path):
    path = tmp_path / "data-parallel.json"
    doc = data_parallel_benchmark(steps=50, batch=2, fail_at=40, gathers=20, rounds=1, json_path=str(path),
                                  say=lambda *_: None)
    assert [(r["round"], r["trainers"]) for r in doc["runs"]] == [(0, 1), (0, 2)]
    one = [r for r in doc["runs"] if r["trainers"] == 1]
    two = [r for r in doc["runs"] if r["trainers"] == 2]
    assert doc["weak_scaling_ratios"] == [b["steps_per_second"] / a["steps_per_second"] for a, b in zip(one, two)]
    assert doc["weak_scaling_ratio"] == median(doc["weak_scaling_ratios"])
    for r in doc["runs"]:  # timed between the warm-up and the failure, never across the recovery
        first, last = r["window_steps"]
        assert 13 <= first < last < 40 and r["exact"]
        assert r["steps_per_second"] > 0 and r["samples_per_step"] == 2 * r["trainers"]
    assert {r["recovered_rank"] for r in two} == {1} and {r["recovered_rank"] for r in one} == {0}
    assert set(one[0]["recovery_phases"]) == {"restart", "rejoin", "constructor", "restore", "waited", "fetch",
                                                     "install", "copy", "replay", "hash"}
    assert {"deliver", "restart", "rejoin", "group", "constructor"} <= set(two[0]["recovery_phases"])
    assert doc["recovery_seconds"] == {"k1": median(r["recovery_seconds"] for r in one),
                                       "k2": median(r["recovery_seconds"] for r in two)}
    assert doc["targets"]["exact"] is True and doc["collective"]["gathers"] == 20
    assert json.loads(path.read_text())["weak_scaling_ratios"] == doc["weak_scaling_ratios"]
    assert f"{doc['weak_scaling_ratio']:.2f}" in markdown(doc)


def test_the_elastic_benchmark_sets_the_three_losses_side_by_side(tmp_path):
    # The table and targets from the runs' own figures (the runs themselves: `python -m benchmarks elastic`).
    from benchmarks.elastic import _report

    throughput = [{"trainers": k, "seconds_per_step": 0.02 * k, "steps_per_second": 50 / k, "final_state_hash": "h",
                   "exact": True} for k in (1, 2, 3)]
    stalls = {"report": [(0.05, 0.02), (0.09, 0.06), (0.07, 0.03)], "unrestarted": [(0.03, 0.02)] * 3,
              "ray": [(1.4, 1.38), (1.6, 1.59), (1.5, 1.47)],
              "fixed": [(4.0, None), (6.0, None), (5.0, None)]}
    losses = [{"round": i, "detection": d, "stall_seconds": s, "plan_wait_seconds": w, "final_state_hash": "h",
               "exact": True} for d, runs in stalls.items() for i, (s, w) in enumerate(runs)]
    doc = _report(throughput, losses, dict(rounds=3, shards=6), str(tmp_path / "elastic.json"))
    report = doc["medians"]["report"]
    assert report == {"stall_seconds": 0.07, "stall_range": [0.05, 0.09], "plan_wait_seconds": 0.03,
                      "after_plan_seconds": pytest.approx(0.03)}
    assert doc["medians"]["fixed"] == {"stall_seconds": 5.0, "stall_range": [4.0, 6.0]}
    assert all(doc["targets"].values())
    assert json.loads((tmp_path / "elastic.json").read_text())["stall_ratio"] == 0.07 / 5.0
