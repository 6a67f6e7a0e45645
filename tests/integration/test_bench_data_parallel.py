"""`zocheck-ray bench data-parallel` on a real Ray instance: k=1 and k=2 runs paired by round,
steps per second timed between the warm-up and the failure, the recovery's phases reported."""

import json
from statistics import median

import pytest

from benchmarks.data_parallel import data_parallel_benchmark, markdown, round_order


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
