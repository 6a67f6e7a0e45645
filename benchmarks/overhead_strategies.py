"""The critical-path comparison of `bench overhead`: every strategy, and ZOCheck against the
asynchronous baseline as the model grows.

`measure_strategies` trains the same job under each strategy of `benchmarks.baselines`
(log-only, sync and async at K = 7, 300, 1000, zocheck with an in-process `Shadow`),
failure-free, on the real `Trainer`, and sums what the training thread spends on
checkpointing: the append that publishes each record (every strategy logs its records)
plus the checkpoint work every K steps (sync: the save; async: waiting for the previous
write, then the staging copy). Output (keys stable):

    {"model", "params", "steps", "intervals",
     "rows": [critical_path dict (see bench.baselines) + {"per_step_us", "final_state_hash"}],
     "final_states_equal": bool,                 # every strategy trained the same bits
     "lowest": {"met", "by_k": {K: {"zocheck_seconds", "others": {strategy: seconds}, "met" (None, with a
                "note", where the run is shorter than K)}},
                "log_only_over_zocheck"}}

`size_ratio` projects ZOCheck's advantage over the async baseline at K (1000) from the
per-size rows of `overhead.measure_size` (measured on the state tensors of each size with
real `ZOOptimizer` steps and a trivial loss, i.e. without forward passes: a full training
run at 100M-1B parameters is too slow on this machine; the critical path is the same
either way). Per step, zocheck pays one append and the async baseline one append plus a
staging copy every K steps, so the ratio of their cumulative costs is
1 + staging_copy / (K * append), linear in the state's size. Output:

    {"every": K, "dtype" (the fitted sizes'; other dtypes are left out), "measured_on": str, "sizes": [{"params", "dtype", "publish_us" (median append after
     a real step), "publish_samples", "staging_copy_ms", "ratio"}],
     "fit": {"intercept", "per_parameter", "r2"} | None, "projected_params",
     "projected_ratio", "target", "paper_ratio", "met"}
"""

from __future__ import annotations

import os
import shutil
import tempfile

from benchmarks.baselines import PAPER_INTERVALS, StrategyTrainer, paper_strategies
from benchmarks.common import bench_job
from benchmarks.recovery_comparison import fit_line

RATIO_EVERY = 1000
RATIO_TARGET = 200.0
PAPER_RATIO = 219.7
PROJECTED_PARAMS = 8_000_000_000
RATIO_MIN_PARAMS = 100_000_000


def measure_strategies(model: str = "tiny-opt", steps: int = 2100, intervals: tuple[int, ...] = PAPER_INTERVALS,
                       storage: str | None = None, say=print) -> dict:
    """Each strategy's cumulative critical-path cost over a failure-free run of `steps` steps."""
    directory = storage or tempfile.mkdtemp(prefix="zocheck-bench-strategies-")
    rows = []
    try:
        for strategy in paper_strategies(tuple(intervals)):
            say(f"  {strategy.name}: {steps} steps ...")
            job = bench_job(model=model, steps=steps, storage=directory, run_id=f"overhead-{strategy.slug}",
                            shadow={"snapshot_interval": 16})
            trainer = StrategyTrainer(job, os.path.join(directory, strategy.slug), strategy)
            trainer.run(steps)
            trainer.close()
            path = trainer.critical_path()
            params = sum(t.numel() for t in trainer.opt.state_tensors().values())
            rows.append({**path, "per_step_us": path["cumulative_seconds"] / max(path["steps"], 1) * 1e6,
                         "final_state_hash": trainer.state_hash()[1]})
    finally:
        if storage is None:
            shutil.rmtree(directory, ignore_errors=True)
    return {"model": model, "params": params, "steps": steps, "intervals": list(intervals), "rows": rows,
            "final_states_equal": len({r["final_state_hash"] for r in rows}) == 1,
            "lowest": lowest_at_every_k(rows, intervals)}


def lowest_at_every_k(rows: list[dict], intervals) -> dict:
    """ZOCheck's cumulative cost against each checkpointing strategy at each K (log-only, which
    publishes the same way and never checkpoints, is reported beside: it bounds no recovery)."""
    by_name = {r["strategy"]: r for r in rows}
    zocheck = by_name.get("zocheck")
    by_k = {}
    for k in intervals:
        others = {n: by_name[n]["cumulative_seconds"] for n in (f"sync K={k}", f"async K={k}") if n in by_name}
        checkpoints = [by_name[n].get("checkpoints", 1) for n in (f"sync K={k}", f"async K={k}") if n in by_name]
        entry = {"zocheck_seconds": zocheck["cumulative_seconds"] if zocheck else None, "others": others,
                 "met": zocheck is not None and all(zocheck["cumulative_seconds"] < v for v in others.values())}
        if checkpoints and not any(checkpoints):
            # A run shorter than K: those strategies only appended records, as zocheck does.
            entry.update(met=None, note=f"no checkpoint at K={k} within the run: not evaluated (run >= K steps)")
        by_k[str(k)] = entry
    log_only = by_name.get("log-only")
    evaluated = [v["met"] for v in by_k.values() if v["met"] is not None]
    return {"met": bool(evaluated) and all(evaluated), "by_k": by_k,
            "log_only_over_zocheck": (log_only["cumulative_seconds"] / zocheck["cumulative_seconds"]
                                      if log_only and zocheck and zocheck["cumulative_seconds"] else None)}


def size_ratio(size_rows: list[dict], every: int = RATIO_EVERY, min_params: int = RATIO_MIN_PARAMS) -> dict:
    """ZOCheck vs async K=`every` from `measure_size` rows of at least `min_params` (module docstring)."""
    sizes = []
    eligible = sorted((r for r in size_rows if r["params"] >= min_params), key=lambda r: r["params"])
    dtype = eligible[0]["dtype"] if eligible else None
    for r in eligible:
        if r["dtype"] != dtype:  # bytes per parameter differ: one line per dtype, the smallest size's
            continue
        # The appends right after real steps (caches cold from streaming the state): what training
        # pays, several times the tight loop's figure, so the ratio is not flattered.
        publish = r["publish_us_median"]
        sizes.append({"params": r["params"], "dtype": r["dtype"], "publish_us": publish, "publish_samples": r["steps"],
                      "staging_copy_ms": r["staging_copy_ms"],
                      "ratio": 1 + r["staging_copy_ms"] * 1e3 / (every * publish)})
    fit = None
    projected = None
    if len(sizes) >= 2:
        a, b, r2 = fit_line([s["params"] for s in sizes], [s["ratio"] for s in sizes])
        fit = {"intercept": a, "per_parameter": b, "r2": r2}
        projected = a + b * PROJECTED_PARAMS
    return {"every": every, "dtype": dtype, "measured_on": "state tensors with real ZOOptimizer steps and a trivial loss "
                                           "(no forward passes)",
            "sizes": sizes, "fit": fit, "projected_params": PROJECTED_PARAMS, "projected_ratio": projected,
            "target": RATIO_TARGET, "paper_ratio": PAPER_RATIO,
            "met": projected is not None and projected >= RATIO_TARGET}


def print_strategies(doc: dict, say=print) -> None:
    from benchmarks.common import print_table

    say(f"\ncritical path over a failure-free run: {doc['model']} ({doc['params']:,} parameters), "
        f"{doc['steps']:,} steps, the real Trainer")
    print_table(doc["rows"], [
        ("strategy", "strategy", ""), ("steps", "steps", "d"), ("checkpoints", "checkpoints", "d"),
        ("publish_us_median", "append us p50", ".2f"), ("publish_seconds", "appends s", ".4f"),
        ("checkpoint_ms_median", "checkpoint ms p50", ".2f"), ("stall_seconds", "stall s", ".3f"),
        ("checkpoint_seconds", "checkpoints s", ".3f"), ("cumulative_seconds", "cumulative s", ".4f"),
        ("per_step_us", "us per step", ".1f"),
    ])
    say("final states equal across strategies: " + ("yes" if doc["final_states_equal"] else "NO"))


def print_ratio(doc: dict, say=print) -> None:
    from benchmarks.common import print_table

    if not doc["sizes"]:
        say(f"\nzocheck vs async K={doc['every']}: no size of at least {RATIO_MIN_PARAMS:,} parameters was measured")
        return
    say(f"\nzocheck vs async K={doc['every']} as the model grows (measured on {doc['measured_on']}):")
    print_table(doc["sizes"], [("params", "params", ","), ("dtype", "dtype", ""), ("publish_us", "append us", ".2f"),
                               ("staging_copy_ms", "staging copy ms", ".1f"), ("ratio", "async/zocheck", ".1f")])
    if doc["projected_ratio"] is not None:
        say(f"linear fit: ratio = {doc['fit']['intercept']:.2f} + {doc['fit']['per_parameter'] * 1e9:.2f} per billion "
            f"parameters; projected at {doc['projected_params'] / 1e9:g}B: {doc['projected_ratio']:.0f}x (target >= "
            f"{doc['target']:g}x, the paper measured {doc['paper_ratio']}x): {'met' if doc['met'] else 'missed'}")
