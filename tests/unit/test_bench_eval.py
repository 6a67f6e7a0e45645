"""The evaluation benchmarks (waste, scaling, memory, all): quick runs whose outputs must hold
what is true whatever the timings: the files exist, the grids are covered, waste grows with the
MTBF, the best K is no worse than any fixed K, the shadow holds at least one state copy, replay
follows the trainer bit for bit."""

from __future__ import annotations

import argparse
import json
import math
import re

import numba
import pytest
import torch

from benchmarks import memory, recovery, scaling, suite, waste, waste_inputs
from conftest import slow_fixture

MTBF = [3.0, 9.0, 15.0]
PARAMS = [100_000, 400_000]
DTYPES = ["fp32", "bf16"]
THREADS = sorted({1, numba.config.NUMBA_NUM_THREADS})
BATCHES, SEQ_LENS = [1, 8], [8, 64]
SHADOW_SIZES = [2_000_000, 8_000_000]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-results")


@slow_fixture(scope="module")  # the waste benchmark at a small scale
def waste_doc(out):
    return waste.waste_benchmark(MTBF, hidden=64, layers=1, steps=2, trials=500, measure_restart=False,
                                 json_path=str(out / "waste.json"), say=lambda *_: None)


@slow_fixture(scope="module")  # the scaling benchmark at a small scale
def scaling_doc(out):
    return scaling.scaling_benchmark(PARAMS, THREADS, DTYPES, BATCHES, SEQ_LENS, repeats=1, hidden=64, layers=1,
                                     json_path=str(out / "scaling.json"), say=lambda *_: None)


@slow_fixture(scope="module")  # the memory benchmark at a small scale
def memory_doc(out):
    return memory.memory_benchmark(SHADOW_SIZES, hidden=128, layers=1, steps=7, strategies=("trainer", "zocheck"),
                                   json_path=str(out / "memory.json"), say=lambda *_: None)


# --------------------------------------------------------------------------- waste


def test_waste_json_has_every_set_mtbf_and_strategy(out, waste_doc):
    doc = json.loads((out / "waste.json").read_text())
    assert doc == json.loads(json.dumps(waste_doc))
    assert [s["name"] for s in doc["sets"]] == ["measured", "paper-qwen3-8b-fp32", "paper-qwen3-8b-bf16"]
    for s in doc["sets"]:
        assert [p["mtbf_hours"] for p in s["points"]] == MTBF
        labels = {r["label"] for r in s["rows"] if r["mtbf_hours"] == MTBF[0]}
        for strategy in ("sync-checkpoint", "async-checkpoint"):
            assert {f"{strategy} K={k}" for k in (7, 300, 1000)} <= labels
            assert any(label.startswith(f"{strategy} best K=") for label in labels)
        assert {"zocheck", "log-only"} <= labels
        # every input is stated with where it comes from
        inputs = doc["inputs"][s["name"]]
        for field in s["timings"]:
            assert inputs[field]["source"], field
    assert doc["inputs"]["paper-qwen3-8b-fp32"]["gpu_step_seconds"]["value"] == 8.65
    assert doc["inputs"]["paper-qwen3-8b-bf16"]["replay_step_seconds"]["value"] == 3.68


def test_waste_per_failure_window_grows_with_mtbf_for_every_strategy(waste_doc):
    for s in waste_doc["sets"]:
        fixed = {}
        for r in s["rows"]:
            key = r["label"] if " best K=" not in r["label"] else r["strategy"] + " best"
            fixed.setdefault(key, []).append(r["waste_seconds"])
        for key, values in fixed.items():
            assert len(values) == len(MTBF), key
            assert all(a <= b + 1e-9 for a, b in zip(values, values[1:])), (s["name"], key, values)


def test_best_interval_is_no_worse_than_any_fixed_interval(waste_doc):
    for s in waste_doc["sets"]:
        for p in s["points"]:
            at = [r for r in s["rows"] if r["mtbf_hours"] == p["mtbf_hours"]]
            for short, strategy in (("async", "async-checkpoint"), ("sync", "sync-checkpoint")):
                fixed = [r["waste_seconds"] for r in at if r["strategy"] == strategy]
                assert p[f"best_{short}_seconds"] <= min(fixed) + 1e-9
            ratio = (p["best_async_seconds"] - s["timings"]["restart_seconds"]) / (
                p["zocheck_seconds"] - s["timings"]["restart_seconds"])
            assert p["best_async_over_zocheck"] == pytest.approx(ratio)
        verdict = s["target"]
        assert verdict["met"] == (verdict["min_ratio"] >= waste.TARGET_RATIO)
        assert verdict["why"]


def test_best_interval_matches_an_exhaustive_search():
    from zocheck_ray.policies import FailureModel, StrategyConfig, Timings, expected_waste

    t = Timings(gpu_step_seconds=8.65, replay_step_seconds=6.59, snapshot_cost_seconds=3.3, persist_seconds=16.4,
                state_copy_seconds=1.3)
    f = FailureModel(mtbf_hours=3)
    k, best = waste.best_interval(t, f, "async-checkpoint")
    exhaustive = min(expected_waste(t, f, StrategyConfig(strategy="async-checkpoint", checkpoint_interval_steps=j)
                                    ).waste_seconds for j in range(1, 400))
    assert best == pytest.approx(exhaustive, rel=1e-12)


def test_waste_rejects_a_bad_mtbf_by_name():
    parser = argparse.ArgumentParser()
    waste.register(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["waste", "--mtbf", "0"])
    with pytest.raises(ValueError, match="--from /nonexistent/results"):
        waste_inputs.from_results("/nonexistent/results", None, {})


# --------------------------------------------------------------------------- scaling


def test_scaling_json_covers_the_requested_grid(out, scaling_doc):
    doc = json.loads((out / "scaling.json").read_text())
    assert {(r["params"], r["dtype"], r["threads"]) for r in doc["replay"]} == {
        (n, d, p) for n in PARAMS for d in DTYPES for p in THREADS}
    assert all(r["replay_seconds"] > 0 and r["bandwidth_limit_seconds"] > 0 for r in doc["replay"])
    assert {(r["batch_size"], r["seq_len"]) for r in doc["batch"]["rows"]} == {
        (b, s) for b in BATCHES for s in SEQ_LENS}
    assert all(math.isfinite(r["fit_seconds_per_param"]) for r in doc["replay"])


def test_scaling_replica_follows_the_trainer_bit_for_bit(scaling_doc):
    assert scaling_doc["batch"]["replica_equals_trainer"] is True


# --------------------------------------------------------------------------- memory


def test_memory_zocheck_and_shadow_hold_at_least_one_state_copy(out, memory_doc):
    doc = json.loads((out / "memory.json").read_text())
    by = {r["strategy"]: r for r in doc["strategies"]}
    assert by["zocheck"]["extra_host_bytes"] >= by["zocheck"]["state_bytes"]
    assert by["zocheck"]["snapshots"] >= 1 and by["zocheck"]["replayed_step"] == doc["steps"]
    assert [r["params"] for r in doc["shadow"]] == SHADOW_SIZES
    for r in doc["shadow"]:
        assert r["extra_host_bytes"] >= r["state_bytes"]
        assert r["state_bytes"] == r["params"] * 4
    assert doc["invariants"]["zocheck_holds_at_least_one_state_copy"]


def test_memory_gpu_column_only_with_cuda(memory_doc):
    cuda = torch.cuda.is_available()
    assert memory_doc["gpu"] == cuda
    assert all((r["peak_gpu_bytes"] is not None) == cuda for r in memory_doc["strategies"])


def test_memory_rejects_a_strategy_list_without_its_baseline():
    with pytest.raises(ValueError, match="trainer"):
        memory.memory_benchmark([1000], strategies=("zocheck",), say=lambda *_: None)


# --------------------------------------------------------------------------- all


def test_the_suite_writes_markdown_figures_machine_and_summary(out, waste_doc, scaling_doc, memory_doc):
    info = suite.describe_machine()
    docs = {"waste": waste_doc, "scaling": scaling_doc, "memory": memory_doc}
    written = suite.write_outputs(docs, out, info, errors={"recovery": "RuntimeError: example"}, quick=True)
    names = {p.name for p in written}
    assert {"waste.md", "scaling.md", "memory.md", "waste.png", "tradeoff.png", "scaling.png", "memory.png",
            "machine.json", "summary.md"} <= names
    for png in ("waste.png", "tradeoff.png", "scaling.png", "memory.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    machine = json.loads((out / "machine.json").read_text())
    assert machine["cpu"] and machine["cpu_count"] >= 1 and machine["memory_bytes"] > 0
    assert len(machine["load_average"]) == 3 and machine["versions"]["torch"]
    summary = (out / "summary.md").read_text()
    assert machine["cpu"] in summary and "recovery**: did not complete" in summary
    for name in docs:
        assert f"**{name}**" in summary and f"({name}.md)" in summary
    table = (out / "waste.md").read_text()
    for s in waste_doc["sets"]:
        assert f"## {s['name']}" in table


def test_the_suite_without_matplotlib_writes_tables_and_summary_and_names_the_missing_figures(
        tmp_path, waste_doc, scaling_doc, memory_doc, no_matplotlib):
    info = suite.describe_machine()  # versions from package metadata: nothing is imported
    docs = {"waste": waste_doc, "scaling": scaling_doc, "memory": memory_doc}
    written = suite.write_outputs(docs, tmp_path, info, quick=True)
    names = {p.name for p in written}
    assert {"waste.md", "scaling.md", "memory.md", "machine.json", "summary.md"} <= names
    assert not any(name.endswith(".png") for name in names) and not list(tmp_path.glob("*.png"))
    summary = (tmp_path / "summary.md").read_text()
    assert "Figures not drawn (waste.png, tradeoff.png, scaling.png, memory.png)" in summary
    assert "zocheck-ray[bench]" in summary
    for name in docs:
        assert f"**{name}**" in summary and f"({name}.md)" in summary


def test_bench_all_rejects_an_unknown_benchmark(tmp_path):
    parser = argparse.ArgumentParser()
    suite.register(parser.add_subparsers())
    args = parser.parse_args(["all", "--out", str(tmp_path), "--only", "waste", "nonsense"])
    with pytest.raises(SystemExit, match="nonsense"):
        args.func(args)


def test_waste_sensitivity_covers_every_variant_and_agrees_as_stated(waste_doc):
    sets = {s["name"]: s for s in waste_doc["sets"]}
    for name, rows in waste_doc["sensitivity"].items():
        assert [r["variant"] for r in rows] == [v for v, _ in waste.SENSITIVITY]
        stated = rows[0]
        assert stated["ratios"][0] == pytest.approx(sets[name]["points"][0]["best_async_over_zocheck"])
        assert stated["ratios"][-1] == pytest.approx(sets[name]["points"][-1]["best_async_over_zocheck"])


def test_waste_takes_restart_and_publish_cost_from_recovery_and_overhead_json(tmp_path):
    from zocheck_ray.policies import Timings

    recoveries = [{"seconds_to_failure_step": total, "process_seconds": inside}
                  for total, inside in ((3.0, 1.0), (4.0, 1.0), (5.0, 2.0))]
    (tmp_path / "recovery.json").write_text(json.dumps({"scenarios": [{"zocheck": {"recoveries": recoveries}}]}))
    (tmp_path / "overhead.json").write_text(json.dumps({"trainer": {"publish_us_median": 2.5}}))
    timings = Timings(gpu_step_seconds=1.0, replay_step_seconds=0.1, snapshot_cost_seconds=0.1, persist_seconds=0.5,
                      restart_seconds=9.0)
    updated, inputs = waste_inputs.from_results(tmp_path, timings, {})
    assert updated.restart_seconds == 3.0  # median of 2, 3, 3
    assert updated.log_step_seconds == 2.5e-6
    assert "recovery.json" in inputs["restart_seconds"]["source"]
    assert "overhead.json" in inputs["log_step_seconds"]["source"]
    (tmp_path / "recovery.json").unlink()
    (tmp_path / "overhead.json").write_text("{}")
    with pytest.raises(ValueError, match="usable figures"):
        waste_inputs.from_results(tmp_path, timings, {})


def test_summary_lists_each_recovery_target_with_its_ratios():
    ratio = {"restore": 2.78, "work": 1.25, "total": 1.10, "process": 1.0, "applicable": True}
    small = {**ratio, "restore": 0.85, "applicable": False}
    targets = {
        "comparison": {
            "over_async_k7": {"target": 1.55, "min_params": 10_000_000, "met": True,
                              "ratios": {"comparison": small, "large": ratio}},
            "over_log_only": {"target": 100.0, "min_params": 10_000_000, "run_steps": 5000, "met": False,
                              "ratios": {"large": {**ratio, "restore": 90.0, "extrapolated": True}}},
            "states_equal": True, "notes": ["large: log-only / zocheck = 90.00x on the restore"]},
        "independent_of_depth": {"met": True, "late_over_early": {"depth": 1.0}},
        "faster_than_async_checkpoint": {"met": False, "zocheck_over_baseline": {"depth/early": 1.0}},
        "notes": ["depth early: a tie"],
    }
    lines = recovery.verdicts({"targets": targets})

    def verdict(line: str) -> str:
        found = set(re.findall(r"\b(met|missed|not run)\b", line))
        assert len(found) == 1, line
        return found.pop()

    # one line per target, then the notes, each once, in the order given
    notes = targets["notes"] + targets["comparison"]["notes"]
    assert len(lines) == 5 + len(notes)
    assert lines[5:] == [line for line in lines if any(n in line for n in notes)]
    assert [next(n for n in notes if n in line) for line in lines[5:]] == notes
    async_k7, log_only = lines[0], lines[1]
    # each comparison target: its goal, its size bound, its verdict and every ratio it was judged on
    for line, key in ((async_k7, "over_async_k7"), (log_only, "over_log_only")):
        t = targets["comparison"][key]
        assert f"{t['target']:g}x" in line and f"{t['min_params']:,}" in line
        assert verdict(line) == ("met" if t["met"] else "missed")
        for name, r in t["ratios"].items():  # a ratio not applicable to the target (too small a model) is marked
            (part,) = [p for p in line.split(";") if re.search(rf"\b{name}\b", p) and f"{r['restore']:.2f}x" in p]
            assert ("(not checked)" in part) == (not r["applicable"]), (name, line)
    assert sum("True" in line for line in lines) == 1  # the states compared equal
    depth, faster = lines[3], lines[4]
    assert verdict(depth) == "met" and "1.00" in depth
    assert verdict(faster) == "missed" and "1.00" in faster
