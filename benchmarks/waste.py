"""`python -m benchmarks waste`: end-to-end wasted time against MTBF, ZOCheck against the baselines.

    python -m benchmarks waste --json benchmarks/results/waste.json
    python -m benchmarks waste --from benchmarks/results --json waste.json   # reuse overhead/recovery JSON

The cost model (`policies.waste.expected_waste`, exact expectations) and the Monte-Carlo
simulator (`policies.simulator.simulate_waste`) turn per-step costs into the expected
wasted time per failure window, for MTBFs of 3 to 15 hours, for:

- zocheck: N chosen by the cost model (`configure`);
- log-only: replay every record since the start of the run (the run is one MTBF long);
- sync and async full checkpoints every K steps, K = 7, 300, 1000 and the best K for
  each MTBF (the integer minimiser of the expected waste, found by search).

Two parameter sets, each as one `Timings`:

(a) `measured`: every cost measured here, in this run, on an OPT model built from a
    config: the trainer's ZO step (two forward passes and the update) for T_gpu, the
    fused replay of one record for T_rep and T_rec, the shadow's snapshot copy
    (`copy_state` into shared memory) for C_snap and the image load, a `SnapshotStore.save` for T_per and the
    synchronous save, a `SnapshotStore.load` for the storage read, the async baseline's
    staging copy (`baselines.stage`) for C_copy, the append that publishes a record for
    the logging cost, and a fresh Python process that imports torch and builds the model
    for the restart (with `--from DIR`, the Ray restart and the publish cost measured by
    `bench recovery` / `bench overhead` replace those two);
(b) `paper-qwen3-8b-fp32` and `-bf16`: the paper's published Qwen3-8B step times (T_gpu
    8.65 s and T_rep 6.59 s in FP32; 2.85 s and 3.68 s in BF16, the keep-pace and lag
    regimes); the paper's text is not at hand here, so every other input is derived
    from the state's size and a stated bandwidth (see `waste_inputs.PAPER_ASSUMPTIONS`, each with why).

Target: the best asynchronous baseline wastes at least 14x more than ZOCheck at every
MTBF from 3 to 15 h (the paper reports 14.0-21.3x). The comparison counts the waste a
checkpointing strategy causes: the process restart, the same for every strategy, is
left out of the target ratio and reported beside it (a shared constant pulls every
ratio towards 1). Where the target is missed, the output says by how much and why.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import numpy as np

from benchmarks.common import STYLE, machine, md_table, print_table, pyplot, write_json
from benchmarks.waste_inputs import PAPER_STEP_TIMES, from_results, measure_timings, paper_timings
from zocheck_ray.policies import (FailureModel, StrategyConfig, Timings, configure, expected_waste, persistence_bound,
                                  simulate_waste)

TARGET_RATIO = 14.0
PAPER_RATIO_RANGE = (14.0, 21.3)
DEFAULT_MTBF_HOURS = [3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0]
FIXED_INTERVALS = (7, 300, 1000)
CHECKPOINT_STRATEGIES = ("sync-checkpoint", "async-checkpoint")

# --------------------------------------------------------------------------- sensitivity


SENSITIVITY = [
    ("as stated", {}),
    ("SSD 1 GB/s", {"storage_bytes_per_second": 1e9}),
    ("SSD 4 GB/s", {"storage_bytes_per_second": 4e9}),
    ("PCIe 12.5 GB/s", {"device_host_bytes_per_second": 12.5e9}),
    ("PCIe 50 GB/s", {"device_host_bytes_per_second": 50e9}),
    ("host copy 5 GB/s", {"host_copy_bytes_per_second": 5e9}),
    ("host copy 20 GB/s", {"host_copy_bytes_per_second": 20e9}),
    ("replay after a failure on the GPU, 0.1 s/record", {"recovery_replay_step_seconds": 0.1}),
]
"""Each stated assumption of the paper set moved by 2x either way (and a GPU-side replay): how the
ratio at the ends of the MTBF range depends on what is not published."""


def sensitivity(precision: str, mtbf_hours: list[float]) -> list[dict]:
    """Best async / zocheck (restart excluded) at the shortest and longest MTBF, per variant."""
    rows = []
    for name, changes in SENSITIVITY:
        timings, _ = paper_timings(precision, **changes)
        ends = sorted({min(mtbf_hours), max(mtbf_hours)})
        points = compare(name, timings, ends, trials=0)["points"]
        rows.append({"variant": name, "changes": changes, "mtbf_hours": ends,
                     "ratios": [p["best_async_over_zocheck"] for p in points],
                     "zocheck_snapshot_interval": points[0]["zocheck_snapshot_interval"]})
    return rows


# --------------------------------------------------------------------------- the comparison


def best_interval(timings: Timings, failures: FailureModel, strategy: str) -> tuple[int, float]:
    """The integer K with the least expected waste: a geometric scan, then a ternary search around its best."""
    def waste(k: int) -> float:
        cfg = StrategyConfig(strategy=strategy, checkpoint_interval_steps=int(k))
        return expected_waste(timings, failures, cfg).waste_seconds

    top = max(2, int(failures.mtbf_seconds / timings.gpu_step_seconds))
    grid = sorted({int(k) for k in np.geomspace(1, top, 160)})
    values = [waste(k) for k in grid]
    i = int(np.argmin(values))
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    while hi - lo > 2:
        a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if waste(a) <= waste(b):
            hi = b
        else:
            lo = a
    k = min(range(lo, hi + 1), key=waste)
    return k, waste(k)


def _entry(timings, failures, config: StrategyConfig, label: str, trials: int, seed: int) -> dict:
    exact = expected_waste(timings, failures, config)
    row = {"strategy": config.strategy, "label": label, "mtbf_hours": failures.mtbf_hours,
           "snapshot_interval": config.snapshot_interval, "checkpoint_interval_steps": config.checkpoint_interval_steps,
           "waste_seconds": exact.waste_seconds, "overhead_seconds": exact.overhead_seconds,
           "recovery_seconds": exact.recovery_seconds, "waste_fraction": exact.waste_fraction,
           "waste_without_restart_seconds": exact.waste_seconds - timings.restart_seconds}
    if trials:
        sim = simulate_waste(timings, failures, config, trials=trials, seed=seed)
        row.update(simulated_seconds=sim.mean_seconds, simulated_ci=[sim.ci_low_seconds, sim.ci_high_seconds])
    return row


def compare(name: str, timings: Timings, mtbf_hours: list[float], trials: int = 20_000, seed: int = 0) -> dict:
    """Every strategy at every MTBF; ratios of the best async (and sync) baseline to ZOCheck."""
    rows, points = [], []
    for m in mtbf_hours:
        failures = FailureModel(mtbf_hours=m)
        at = [_entry(timings, failures, configure(timings, failures, "zocheck"), "zocheck", trials, seed),
              _entry(timings, failures, configure(timings, failures, "log-only"), "log-only", trials, seed)]
        best = {}
        for strategy in CHECKPOINT_STRATEGIES:
            for k in FIXED_INTERVALS:
                at.append(_entry(timings, failures, StrategyConfig(strategy=strategy, checkpoint_interval_steps=k),
                                 f"{strategy} K={k}", trials, seed))
            k, _ = best_interval(timings, failures, strategy)
            best[strategy] = _entry(timings, failures, StrategyConfig(strategy=strategy, checkpoint_interval_steps=k),
                                    f"{strategy} best K={k}", trials, seed)
            at.append(best[strategy])
        rows.extend(at)
        z = at[0]
        point = {"mtbf_hours": m, "zocheck_seconds": z["waste_seconds"], "zocheck_snapshot_interval":
                 z["snapshot_interval"]}
        for strategy, short in (("async-checkpoint", "async"), ("sync-checkpoint", "sync")):
            b = best[strategy]
            point[f"best_{short}_k"] = b["checkpoint_interval_steps"]
            point[f"best_{short}_seconds"] = b["waste_seconds"]
            point[f"best_{short}_over_zocheck"] = _ratio(b["waste_without_restart_seconds"],
                                                         z["waste_without_restart_seconds"])
            point[f"best_{short}_over_zocheck_with_restart"] = _ratio(b["waste_seconds"], z["waste_seconds"])
        point["log_only_over_zocheck"] = _ratio(at[1]["waste_without_restart_seconds"],
                                                z["waste_without_restart_seconds"])
        if trials:
            point["simulated_best_async_over_zocheck"] = _ratio(
                best["async-checkpoint"]["simulated_seconds"] - timings.restart_seconds,
                z["simulated_seconds"] - timings.restart_seconds)
        points.append(point)
    ratios = [p["best_async_over_zocheck"] for p in points]
    with_restart = [p["best_async_over_zocheck_with_restart"] for p in points]
    met = all(r >= TARGET_RATIO for r in ratios)
    verdict = {"met": met, "min_ratio": min(ratios), "max_ratio": max(ratios),
               "min_ratio_with_restart": min(with_restart), "max_ratio_with_restart": max(with_restart),
               "met_with_restart": all(r >= TARGET_RATIO for r in with_restart),
               "paper_range": list(PAPER_RATIO_RANGE), "why": _why(name, timings, points, met)}
    return {"name": name, "timings": timings.model_dump(), "regime": "keep-pace" if timings.replay_step_seconds <
            timings.gpu_step_seconds else "lag", "rows": rows, "points": points, "target": verdict}


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def _why(name: str, t: Timings, points: list[dict], met: bool) -> str:
    first, last = points[0], points[-1]
    text = (f"ZOCheck's waste is flat in MTBF ({first['zocheck_seconds'] - t.restart_seconds:.3g} s at "
            f"{first['mtbf_hours']:g} h, {last['zocheck_seconds'] - t.restart_seconds:.3g} s at "
            f"{last['mtbf_hours']:g} h without the restart) while the best async baseline's grows like "
            f"sqrt(2 C_copy M) (Young-Daly), so the ratio rises with the MTBF")
    if t.replay_step_seconds >= t.gpu_step_seconds:
        text += (f"; here T_rep {t.replay_step_seconds:g} s >= T_gpu {t.gpu_step_seconds:g} s (lag regime): the "
                 "shadow falls behind, so resync copies and the lag replayed at recovery grow with the MTBF too")
    elif not met:
        low = [p for p in points if p["best_async_over_zocheck"] < TARGET_RATIO]
        n = first["zocheck_snapshot_interval"]
        bound = (f"persistence bound T_per/T_rep = {t.persist_seconds:.3g} s / {t.replay_step_seconds:.3g} s"
                 if n == math.ceil(persistence_bound(t)) else "pacing bound C_snap/(T_gpu - T_rep)")
        text += (f"; below {TARGET_RATIO:g}x up to {low[-1]['mtbf_hours']:g} h: there sqrt(2 C_copy M) "
                 f"(C_copy {t.state_copy:.3g} s) is still short next to ZOCheck's recovery, the image load "
                 f"({t.load:.3g} s) plus N/2+1 = {n / 2 + 1:g} records replayed at {t.recovery_replay_step:.3g} s each, "
                 f"with N = {n} set by the {bound}")
    if t.restart_seconds > 0:
        text += (f"; a restart of {t.restart_seconds:.3g} s, paid alike by every strategy, brings the ratio to "
                 f"{min(p['best_async_over_zocheck_with_restart'] for p in points):.2f}-"
                 f"{max(p['best_async_over_zocheck_with_restart'] for p in points):.2f}x")
    return text


def print_comparison(result: dict, say=print) -> None:
    t = result["timings"]
    say(f"\n[{result['name']}] regime {result['regime']}: T_gpu {t['gpu_step_seconds']:.4g} s, T_rep "
        f"{t['replay_step_seconds']:.4g} s, C_snap {t['snapshot_cost_seconds']:.3g} s, T_per {t['persist_seconds']:.3g} s, "
        f"C_copy {t['state_copy_seconds']:.3g} s, restart {t['restart_seconds']:.3g} s")
    table = []
    for p in result["points"]:
        m = p["mtbf_hours"]
        by = {r["label"]: r for r in result["rows"] if r["mtbf_hours"] == m}
        row = {"mtbf": m, "zocheck": p["zocheck_seconds"], "n": p["zocheck_snapshot_interval"],
               "log": by["log-only"]["waste_seconds"]}
        for s, short in (("sync-checkpoint", "sync"), ("async-checkpoint", "async")):
            for k in FIXED_INTERVALS:
                row[f"{short}{k}"] = by[f"{s} K={k}"]["waste_seconds"]
            row[f"{short}_best"] = p[f"best_{short}_seconds"]
            row[f"{short}_k"] = p[f"best_{short}_k"]
        row["ratio"] = p["best_async_over_zocheck"]
        row["ratio_r"] = p["best_async_over_zocheck_with_restart"]
        table.append(row)
    print_table(table, [
        ("mtbf", "MTBF h", "g"), ("zocheck", "zocheck s", ".4g"), ("n", "N", "d"), ("log", "log-only s", ".4g"),
        ("sync7", "sync K=7", ".4g"), ("sync300", "K=300", ".4g"), ("sync1000", "K=1000", ".4g"),
        ("sync_best", "best", ".4g"), ("sync_k", "K*", "d"),
        ("async7", "async K=7", ".4g"), ("async300", "K=300", ".4g"), ("async1000", "K=1000", ".4g"),
        ("async_best", "best", ".4g"), ("async_k", "K*", "d"),
        ("ratio", "best async/zocheck", ".1f"), ("ratio_r", "with restart", ".1f"),
    ])
    v = result["target"]
    say(f"  target >= {TARGET_RATIO:g}x at every MTBF (restart excluded): {'met' if v['met'] else 'MISSED'} "
        f"({v['min_ratio']:.1f}-{v['max_ratio']:.1f}x; the paper: {PAPER_RATIO_RANGE[0]:g}-{PAPER_RATIO_RANGE[1]:g}x); "
        f"with the restart: {v['min_ratio_with_restart']:.1f}-{v['max_ratio_with_restart']:.1f}x")
    say(f"  why: {v['why']}")


def waste_benchmark(mtbf_hours: list[float] | None = None, *, hidden: int = 512, layers: int = 4, steps: int = 5,
                    trials: int = 20_000, from_dir: str | None = None, from_required: bool = True,
                    measure_restart: bool = True,
                    json_path: str | None = None, say=print) -> dict:
    """Measure, compare both parameter sets, print, check the target; returns the JSON document.

    Keys: benchmark, machine, mtbf_hours, target_ratio, paper_ratio_range, inputs {set name -> {field ->
    {value, source}}}, sets (one `compare` result per set: name, timings, regime, rows, points, target),
    targets {met, per_set {name -> met}, notes}.
    """
    mtbf_hours = sorted(mtbf_hours or DEFAULT_MTBF_HOURS)
    info = machine()
    info["load_average_before"] = list(os.getloadavg())
    say(f"waste benchmark: MTBF {', '.join(f'{m:g}' for m in mtbf_hours)} h; measuring the inputs on {info['cpu']} ...")
    measured, measured_inputs = measure_timings(hidden, layers, steps=steps, measure_restart=measure_restart)
    if from_dir:
        try:
            measured, measured_inputs = from_results(from_dir, measured, measured_inputs)
        except ValueError as error:
            if from_required:
                raise
            say(f"  {error}; the restart and publishing cost measured here are used")
    sets = [("measured", measured, measured_inputs)]
    for precision in PAPER_STEP_TIMES:
        timings, inputs = paper_timings(precision)
        sets.append((f"paper-qwen3-8b-{precision}", timings, inputs))
    results = []
    for name, timings, _ in sets:
        results.append(compare(name, timings, mtbf_hours, trials))
        print_comparison(results[-1], say)
    sensitivities = {}
    for precision in PAPER_STEP_TIMES:
        sensitivities[f"paper-qwen3-8b-{precision}"] = rows = sensitivity(precision, mtbf_hours)
        say(f"\n[paper-qwen3-8b-{precision}] sensitivity to the stated assumptions (best async / zocheck, restart "
            f"excluded, at {rows[0]['mtbf_hours'][0]:g} h and {rows[0]['mtbf_hours'][-1]:g} h):")
        print_table([{**r, "lo": r["ratios"][0], "hi": r["ratios"][-1]} for r in rows], [
            ("variant", "variant", ""), ("zocheck_snapshot_interval", "N", "d"), ("lo", "shortest MTBF", ".1f"),
            ("hi", "longest MTBF", ".1f")])
    per_set = {r["name"]: r["target"]["met"] for r in results}
    # The target names the paper's published Qwen3-8B times; its range was reported for the keep-pace (FP32) case.
    required = ["measured", "paper-qwen3-8b-fp32"]
    met = all(per_set[n] for n in required)
    notes = [f"{r['name']}: {r['target']['min_ratio']:.1f}x at worst, below {TARGET_RATIO:g}x; {r['target']['why']}"
             for r in results if not r["target"]["met"]]
    say(f"\ntarget (>= {TARGET_RATIO:g}x at every MTBF with the measured and the paper's FP32 Qwen3-8B parameters): "
        f"{'met' if met else 'MISSED'}")
    for r in results:
        v = r["target"]
        say(f"  {r['name']}: {v['min_ratio']:.1f}-{v['max_ratio']:.1f}x against the paper's "
            f"{PAPER_RATIO_RANGE[0]:g}-{PAPER_RATIO_RANGE[1]:g}x ({'met' if v['met'] else 'missed'})")
    info["load_average_after"] = list(os.getloadavg())
    doc = {"benchmark": "waste", "machine": info, "mtbf_hours": mtbf_hours, "target_ratio": TARGET_RATIO,
           "paper_ratio_range": list(PAPER_RATIO_RANGE), "trials": trials,
           "inputs": {name: inputs for name, _, inputs in sets}, "sets": results, "sensitivity": sensitivities,
           "targets": {"met": met, "required_sets": required, "per_set": per_set, "notes": notes}}
    write_json(json_path, doc)
    return doc


def _hours(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of hours") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: an MTBF must be a positive number of hours")
    return value


def run(args: argparse.Namespace) -> int:
    if args.hidden < 8 or args.layers < 1 or args.steps < 2 or args.trials < 0 or args.trials == 1:
        raise SystemExit("--hidden >= 8, --layers >= 1, --steps >= 2 and --trials 0 or >= 2 are required")
    try:
        doc = waste_benchmark(args.mtbf, hidden=args.hidden, layers=args.layers, steps=args.steps, trials=args.trials,
                              from_dir=args.from_dir, measure_restart=not args.no_restart, json_path=args.json)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    return 0 if doc["targets"]["met"] else 1


# ------------------------------------------------------------ in `bench all`: options, tables, figures, verdicts

SUITE_OPTIONS = {"quick": {"hidden": 256, "layers": 2, "steps": 3, "trials": 2000}, "full": {}}
"""`waste_benchmark` options of `bench all`'s run (`--quick` or not)."""


def run_in_suite(out: Path, quick: bool) -> dict:
    """`bench all`'s run, taking the restart and publish costs from the overhead and recovery runs in `out`."""
    have = any((out / f).is_file() for f in ("overhead.json", "recovery.json"))
    return waste_benchmark(from_dir=str(out) if have else None, from_required=False, json_path=str(out / "waste.json"),
                           **SUITE_OPTIONS["quick" if quick else "full"])


def markdown(doc: dict) -> str:
    parts = [f"# Wasted time against MTBF\n\nTarget: the best asynchronous baseline wastes >= "
             f"{doc['target_ratio']:g}x more than ZOCheck at every MTBF (the paper: "
             f"{doc['paper_ratio_range'][0]:g}-{doc['paper_ratio_range'][1]:g}x). Ratios leave out the process "
             "restart, which every strategy pays alike; the column 'with restart' keeps it. "
             f"Overall: **{'met' if doc['targets']['met'] else 'missed'}** (required sets: "
             f"{', '.join(doc['targets']['required_sets'])})."]
    for s in doc["sets"]:
        v = s["target"]
        parts.append(f"## {s['name']} ({s['regime']})\n")
        inputs = doc["inputs"][s["name"]]
        parts.append(md_table([{"field": k, "value": e["value"], "source": e["source"]} for k, e in inputs.items()
                               if isinstance(e, dict) and "value" in e],
                              [("field", "input", ""), ("value", "value", ".4g"), ("source", "source", "")]))
        rows = []
        for p in s["points"]:
            by = {r["label"]: r for r in s["rows"] if r["mtbf_hours"] == p["mtbf_hours"]}
            rows.append({**p, "log": by["log-only"]["waste_seconds"],
                         **{f"a{k}": by[f"async-checkpoint K={k}"]["waste_seconds"] for k in (7, 300, 1000)},
                         **{f"s{k}": by[f"sync-checkpoint K={k}"]["waste_seconds"] for k in (7, 300, 1000)}})
        parts.append("\nExpected wasted time per failure window, seconds:\n")
        parts.append(md_table(rows, [
            ("mtbf_hours", "MTBF h", "g"), ("zocheck_seconds", "zocheck", ".4g"), ("zocheck_snapshot_interval", "N", "d"),
            ("log", "log-only", ".4g"), ("s7", "sync K=7", ".4g"), ("s300", "sync K=300", ".4g"),
            ("s1000", "sync K=1000", ".4g"), ("best_sync_seconds", "sync best", ".4g"), ("best_sync_k", "K*", "d"),
            ("a7", "async K=7", ".4g"), ("a300", "async K=300", ".4g"), ("a1000", "async K=1000", ".4g"),
            ("best_async_seconds", "async best", ".4g"), ("best_async_k", "K*", "d"),
            ("best_async_over_zocheck", "best async / zocheck", ".1f"),
            ("best_async_over_zocheck_with_restart", "with restart", ".1f"),
            ("simulated_best_async_over_zocheck", "simulated", ".1f")]))
        parts.append(f"\nTarget {'met' if v['met'] else '**missed**'}: {v['min_ratio']:.1f}-{v['max_ratio']:.1f}x "
                     f"(with the restart {v['min_ratio_with_restart']:.1f}-{v['max_ratio_with_restart']:.1f}x). "
                     f"Why: {v['why']}.\n")
    for name, rows in doc.get("sensitivity", {}).items():
        ends = rows[0]["mtbf_hours"]
        parts.append(f"## Sensitivity of {name} to its stated assumptions\n\nBest async / zocheck, restart "
                     f"excluded, at {ends[0]:g} h and {ends[-1]:g} h, each assumption moved by 2x (or replay after a "
                     "failure done on the GPU):\n")
        parts.append(md_table([{**r, "lo": r["ratios"][0], "hi": r["ratios"][-1]} for r in rows], [
            ("variant", "variant", ""), ("zocheck_snapshot_interval", "N", "d"), ("lo", f"{ends[0]:g} h", ".1f"),
            ("hi", f"{ends[-1]:g} h", ".1f")]) + "\n")
    return "\n".join(parts) + "\n"


def plot_waste(doc: dict, path: Path) -> None:
    plt = pyplot()
    sets = doc["sets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets), 4.2), squeeze=False)
    for ax, s in zip(axes[0], sets):
        mtbf = [p["mtbf_hours"] for p in s["points"]]
        series = {"zocheck": [p["zocheck_seconds"] for p in s["points"]],
                  "async best K": [p["best_async_seconds"] for p in s["points"]],
                  "sync best K": [p["best_sync_seconds"] for p in s["points"]]}
        for label in ("log-only", "async-checkpoint K=7", "async-checkpoint K=1000"):
            series[label.replace("-checkpoint", "")] = [r["waste_seconds"] for r in s["rows"] if r["label"] == label]
        colors = {"zocheck": "tab:green", "async best K": "tab:orange", "sync best K": "tab:blue",
                  "log-only": "tab:gray", "async K=7": "tab:red", "async K=1000": "tab:brown"}
        for label, values in series.items():
            ax.plot(mtbf, values, marker="o", ms=3, label=label, color=colors[label],
                    lw=2.2 if label == "zocheck" else 1.2)
        ax.set_yscale("log")
        ax.set_xlabel("MTBF (hours)")
        ax.set_title(f"{s['name']}\nbest async / zocheck {s['target']['min_ratio']:.1f}-{s['target']['max_ratio']:.1f}x",
                     fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("expected wasted time per failure window (s)")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tradeoff(doc: dict, path: Path, mtbf_hours: float | None = None) -> None:
    """Per strategy and K: critical-path overhead per failure window against recovery per failure."""
    plt = pyplot()
    sets = doc["sets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets), 4.2), squeeze=False)
    for ax, s in zip(axes[0], sets):
        hours = sorted({r["mtbf_hours"] for r in s["rows"]})
        m = mtbf_hours if mtbf_hours in hours else hours[len(hours) // 2]
        for r in (r for r in s["rows"] if r["mtbf_hours"] == m):
            color, marker = STYLE[r["strategy"]]
            x = max(r["overhead_seconds"], 1e-6)
            y = max(r["recovery_seconds"] - s["timings"]["restart_seconds"], 1e-6)
            ax.scatter([x], [y], color=color, marker=marker, s=60 if r["strategy"] == "zocheck" else 30)
            ax.annotate(r["label"].replace("-checkpoint", "").replace("best ", "*"), (x, y), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"critical-path overhead per failure window (s), MTBF {m:g} h")
        ax.set_title(s["name"], fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("recovery per failure, restart excluded (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FIGURES = [("waste.png", plot_waste), ("tradeoff.png", plot_tradeoff)]
"""(file name, plot(doc, path)) of each figure `bench all` draws from this benchmark's document."""


def verdicts(doc: dict) -> list[str]:
    """The summary's lines for this benchmark's targets."""
    return [f"wasted time, best async / zocheck >= {doc['target_ratio']:g}x at every MTBF: "
            f"{'met' if doc['targets']['met'] else 'missed'}; "
            + "; ".join(f"{s['name']} {s['target']['min_ratio']:.1f}-{s['target']['max_ratio']:.1f}x"
                        for s in doc["sets"])
            + f" (the paper: {doc['paper_ratio_range'][0]:g}-{doc['paper_ratio_range'][1]:g}x)"]


def register(bench) -> None:
    parser = bench.add_parser("waste", help="wasted time against MTBF: ZOCheck vs log-only vs sync/async checkpoints",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mtbf", nargs="+", type=_hours, default=DEFAULT_MTBF_HOURS, metavar="H",
                        help="MTBFs in hours (default 3 5 7 9 11 13 15)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the measured OPT (default 512: ~14M)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the measured OPT (default 4)")
    parser.add_argument("--steps", type=int, default=5, help="timed trainer steps (default 5)")
    parser.add_argument("--trials", type=int, default=20_000,
                        help="Monte-Carlo failure windows per strategy and MTBF (0: closed form only; default 20000)")
    parser.add_argument("--from", dest="from_dir", metavar="DIR",
                        help="take the restart and publish cost from DIR/recovery.json and DIR/overhead.json")
    parser.add_argument("--no-restart", action="store_true", help="do not measure a process restart (counts as 0)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.set_defaults(func=run)
