"""`zocheck-ray bench waste`: end-to-end wasted time against MTBF, ZOCheck against the baselines.

    zocheck-ray bench waste --json benchmarks/results/waste.json
    zocheck-ray bench waste --from benchmarks/results --json waste.json   # reuse overhead/recovery JSON

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
    (`pack_into`) for C_snap and the image load, a `SnapshotStore.save` for T_per and the
    synchronous save, a `SnapshotStore.load` for the storage read, the async baseline's
    staging copy (`baselines.stage`) for C_copy, the append that publishes a record for
    the logging cost, and a fresh Python process that imports torch and builds the model
    for the restart (with `--from DIR`, the Ray restart and the publish cost measured by
    `bench recovery` / `bench overhead` replace those two);
(b) `paper-qwen3-8b-fp32` and `-bf16`: the paper's published Qwen3-8B step times (T_gpu
    8.65 s and T_rep 6.59 s in FP32; 2.85 s and 3.68 s in BF16, the keep-pace and lag
    regimes); the paper's text is not at hand here, so every other input is derived
    from the state's size and a stated bandwidth (see `PAPER_ASSUMPTIONS`, each with why).

Target: the best asynchronous baseline wastes at least 14x more than ZOCheck at every
MTBF from 3 to 15 h (the paper reports 14.0-21.3x). The comparison counts the waste a
checkpointing strategy causes: the process restart, the same for every strategy, is
left out of the target ratio and reported beside it (a shared constant pulls every
ratio towards 1). Where the target is missed, the output says by how much and why.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

from zocheck_ray.bench.common import machine, print_table, write_json
from zocheck_ray.policies import (FailureModel, StrategyConfig, Timings, configure, expected_waste, persistence_bound,
                                  simulate_waste)

TARGET_RATIO = 14.0
PAPER_RATIO_RANGE = (14.0, 21.3)
DEFAULT_MTBF_HOURS = [3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0]
FIXED_INTERVALS = (7, 300, 1000)
CHECKPOINT_STRATEGIES = ("sync-checkpoint", "async-checkpoint")

QWEN3_8B_PARAMS = 8.19e9
"""Qwen3-8B's parameter count (8.2 B, embeddings included)."""
PAPER_STEP_TIMES = {
    "fp32": {"gpu_step_seconds": 8.65, "replay_step_seconds": 6.59, "bytes_per_param": 4},
    "bf16": {"gpu_step_seconds": 2.85, "replay_step_seconds": 3.68, "bytes_per_param": 2},
}
"""The paper's Qwen3-8B step times (seconds): GPU step and CPU replay step, per precision."""
PAPER_ASSUMPTIONS = {
    "device_host_bytes_per_second": (25e9, "pinned PCIe 4.0 x16 transfers reach ~25 GB/s: the async "
                                     "baseline's staging copy, a resync and loading an image into the GPU"),
    "host_copy_bytes_per_second": (10e9, "one-socket host memcpy of a many-GB buffer (the shadow's snapshot "
                                   "copy, which competes with its own replay threads)"),
    "storage_bytes_per_second": (2e9, "one local NVMe SSD, sequential write and read of a full checkpoint "
                                 "or snapshot"),
    "log_step_seconds": (24e-6, "the paper's measured cost of logging one step record"),
    "restart_seconds": (60.0, "relaunching the training process and re-initialising CUDA and the model; the "
                        "same for every strategy, reported beside the target ratio, not in it"),
    "recovery_replay": ("T_rep", "records since the snapshot are replayed at the shadow's CPU rate (a GPU-side "
                        "replay would be faster, so this favours the baselines)"),
}


# --------------------------------------------------------------------------- parameter sets


def paper_timings(precision: str, **changes) -> tuple[Timings, dict]:
    """The paper's step times plus stated bandwidths for an 8B state; (Timings, inputs with sources).
    `changes` replace assumptions (e.g. storage_bytes_per_second=4e9) or, by field name, any input."""
    spec = PAPER_STEP_TIMES[precision]
    nbytes = QWEN3_8B_PARAMS * spec["bytes_per_param"]
    assumed = {k: changes.get(k, v[0]) for k, v in PAPER_ASSUMPTIONS.items()}
    d2h, host, disk = (assumed[k] for k in
                       ("device_host_bytes_per_second", "host_copy_bytes_per_second", "storage_bytes_per_second"))
    why = {k: v[1] for k, v in PAPER_ASSUMPTIONS.items()}
    inputs = {
        "gpu_step_seconds": (spec["gpu_step_seconds"], f"paper: Qwen3-8B {precision.upper()} GPU step"),
        "replay_step_seconds": (spec["replay_step_seconds"], f"paper: Qwen3-8B {precision.upper()} CPU replay step"),
        "snapshot_cost_seconds": (nbytes / host, f"{nbytes / 1e9:.1f} GB at {host / 1e9:g} GB/s: "
                                  + why["host_copy_bytes_per_second"]),
        "persist_seconds": (nbytes / disk, f"{nbytes / 1e9:.1f} GB at {disk / 1e9:g} GB/s: "
                            + why["storage_bytes_per_second"]),
        "checkpoint_save_seconds": (nbytes / disk, "as persist_seconds: the same bytes to the same SSD"),
        "storage_read_seconds": (nbytes / disk, f"{nbytes / 1e9:.1f} GB at {disk / 1e9:g} GB/s"),
        "state_copy_seconds": (nbytes / d2h, f"{nbytes / 1e9:.1f} GB at {d2h / 1e9:g} GB/s: "
                               + why["device_host_bytes_per_second"]),
        "load_seconds": (nbytes / d2h, "host-to-device copy of the image, as state_copy_seconds"),
        "recovery_replay_step_seconds": (spec["replay_step_seconds"], why["recovery_replay"]),
        "log_step_seconds": (assumed["log_step_seconds"], why["log_step_seconds"]),
        "restart_seconds": (assumed["restart_seconds"], why["restart_seconds"]),
    }
    for field in set(changes) & set(inputs):
        inputs[field] = (changes[field], "changed for the sensitivity analysis")
    return Timings(**{k: v for k, (v, _) in inputs.items()}), _describe(inputs)


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


def _describe(inputs: dict) -> dict:
    return {k: {"value": v, "source": s} for k, (v, s) in inputs.items()}


def _opt_model(hidden: int, layers: int, vocab: int = 2048):
    from zocheck_ray.workload.models import build_model

    overrides = dict(hidden_size=hidden, num_hidden_layers=layers, ffn_dim=4 * hidden, word_embed_proj_dim=hidden,
                     vocab_size=vocab, num_attention_heads=max(1, hidden // 64), max_position_embeddings=512)
    return build_model("tiny-opt", "fp32", seed=0, overrides=overrides), overrides


def _median_time(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


_RESTART_SCRIPT = """
import sys, time
start = time.perf_counter()
import torch
from zocheck_ray.workload.models import build_model
build_model("tiny-opt", "fp32", seed=0, overrides={overrides!r})
print(time.perf_counter() - start)
"""


def measure_restart_seconds(overrides: dict) -> float:
    """A fresh Python process importing torch and building the model: what a restarted trainer does first."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", _RESTART_SCRIPT.format(overrides=overrides)], check=True,
                   capture_output=True, text=True, cwd=os.getcwd(),
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    return time.perf_counter() - start


def measure_timings(hidden: int = 512, layers: int = 4, batch_size: int = 4, seq_len: int = 64, steps: int = 5,
                    repeats: int = 3, threads: int | None = None, measure_restart: bool = True,
                    storage: str | None = None) -> tuple[Timings, dict]:
    """Every cost-model input measured on this machine (see the module docstring)."""
    import torch

    from zocheck_ray.actors.image import ImageLayout, new_buffer, pack_into
    from zocheck_ray.bench.baselines import stage
    from zocheck_ray.core import ZOConfig, ZOOptimizer, replay
    from zocheck_ray.storage import SnapshotStore
    from zocheck_ray.workload.data import batch_indices, corpus_tensor, step_seed
    from zocheck_ray.workload.models import trainable_parameters

    model, overrides = _opt_model(hidden, layers)
    params = sum(p.numel() for _, p in trainable_parameters(model))
    config = ZOConfig(lr=1e-5, eps=1e-3)
    opt = ZOOptimizer(trainable_parameters(model), config)
    initial = {k: v.detach().clone() for k, v in opt.state_tensors().items()}
    data = corpus_tensor(seq_len, model.config.vocab_size)
    records, step_seconds = [], []
    with torch.no_grad():
        for t in range(steps + 1):
            ids = data[batch_indices(0, t, batch_size, data.shape[0])]
            start = time.perf_counter()
            records.append(opt.step(lambda: model(input_ids=ids, labels=ids).loss, seed=step_seed(0, t)))
            step_seconds.append(time.perf_counter() - start)
    gpu_step = statistics.median(step_seconds[1:])  # the first step warms up

    replica = {k: v.clone() for k, v in initial.items()}
    replay(replica, records[:1], config, threads=threads)  # compiles or loads the kernel
    replay_samples = []
    for r in records[1:]:
        start = time.perf_counter()
        replay(replica, [r], config, threads=threads, start_step=r.step)
        replay_samples.append(time.perf_counter() - start)
    replay_step = statistics.median(replay_samples)

    layout = ImageLayout.of(replica)
    buffer = new_buffer(layout)
    snapshot = _median_time(lambda: pack_into(buffer, replica, layout), repeats)
    live = opt.state_tensors()
    load = _median_time(lambda: [live[k].copy_(replica[k]) for k in live], repeats)
    staging = stage(live)
    state_copy = _median_time(lambda: stage(live, out=staging), repeats)
    del staging

    appended: deque = deque()
    ns = []
    for r in records * 200:
        start = time.perf_counter_ns()
        appended.append(r)
        ns.append(time.perf_counter_ns() - start)
    log_step = statistics.median(ns) / 1e9

    directory = tempfile.mkdtemp(prefix="zocheck-bench-waste-", dir=storage)
    try:
        store = SnapshotStore(directory)
        saves = []
        for i in range(repeats):
            start = time.perf_counter()
            store.save(i + 1, replica, {"run_id": "bench-waste"})
            saves.append(time.perf_counter() - start)
        persist = statistics.median(saves)
        latest = store.latest()
        read = _median_time(lambda: store.load(latest), repeats)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    restart = measure_restart_seconds(overrides) if measure_restart else 0.0
    size = f"{params / 1e6:.1f}M-parameter OPT (hidden {hidden}, {layers} layers), fp32"
    inputs = {
        "gpu_step_seconds": (gpu_step, f"median ZO step (2 forward passes + update) of the {size}, batch "
                             f"{batch_size} x {seq_len} tokens, {steps} steps, on this CPU"),
        "replay_step_seconds": (replay_step, "median fused replay of one record (core.replay)"),
        "snapshot_cost_seconds": (snapshot, "median shadow snapshot copy (actors.image.pack_into)"),
        "persist_seconds": (persist, "median SnapshotStore.save to a local directory"),
        "checkpoint_save_seconds": (persist, "as persist_seconds: the sync baseline writes the same store"),
        "storage_read_seconds": (read, "median SnapshotStore.load (hashes verified)"),
        "state_copy_seconds": (state_copy, "median async-baseline staging copy (bench.baselines.stage)"),
        "load_seconds": (load, "median copy of an image into the optimizer's live tensors"),
        "recovery_replay_step_seconds": (replay_step, "the CPU trainer replays with the same fused kernel"),
        "log_step_seconds": (log_step, "median deque.append of a record, the trainer's whole publishing cost"),
        "restart_seconds": (restart, "a fresh Python process importing torch and building the model"
                            if measure_restart else "not measured (--no-restart)"),
    }
    doc = _describe(inputs)
    doc["model"] = {"params": params, "hidden": hidden, "layers": layers, "batch_size": batch_size,
                    "seq_len": seq_len, "state_bytes": layout.nbytes}
    return Timings(**{k: v for k, (v, _) in inputs.items()}), doc


def from_results(directory: str | os.PathLike, timings: Timings, inputs: dict) -> tuple[Timings, dict]:
    """Replace the restart and the publishing cost by what `bench recovery` / `bench overhead` measured."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"--from {directory}: not a directory (expected one holding overhead.json/recovery.json)")
    updates = {}
    recovery = directory / "recovery.json"
    if recovery.is_file():
        doc = json.loads(recovery.read_text())
        gaps = [r["seconds_to_failure_step"] - r["process_seconds"] for s in doc.get("scenarios", [])
                for r in s.get("zocheck", {}).get("recoveries", []) if r.get("process_seconds") is not None]
        if gaps:
            updates["restart_seconds"] = (statistics.median(gaps), f"{recovery}: median Ray restart of the trainer "
                                          "(recovery total minus the time inside the restarted process)")
    overhead = directory / "overhead.json"
    if overhead.is_file():
        doc = json.loads(overhead.read_text())
        trainer = doc.get("trainer") or {}
        if trainer.get("publish_us_median") is not None:
            updates["log_step_seconds"] = (trainer["publish_us_median"] / 1e6,
                                           f"{overhead}: the TrainerActor's median publish cost")
    if not updates:
        raise ValueError(f"--from {directory}: found neither recovery.json nor overhead.json with usable figures")
    inputs = {**inputs, **_describe(updates)}
    return timings.model_copy(update={k: v for k, (v, _) in updates.items()}), inputs


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


def register(commands, bench) -> None:
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
