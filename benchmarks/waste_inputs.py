"""The inputs of `bench waste`: the paper's Qwen3-8B parameter set and the costs measured here.

    timings, inputs = paper_timings("fp32")                 # inputs: field -> {value, source}
    timings, inputs = measure_timings(hidden=512, layers=4)  # every cost measured on this machine
    timings, inputs = from_results("benchmarks/results", timings, inputs)

Each input comes with where it came from (the paper, a stated assumption and why, or the
measurement that produced it); `bench waste` prints them beside its tables.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from zocheck_ray.policies import Timings

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

    from benchmarks.baselines import stage
    from zocheck_ray.host.image import ImageLayout, SharedBuffer, copy_state
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
    replay(replica, records[:1], config, threads=threads, start_step=records[0].step)  # compiles or loads the kernel
    replay_samples = []
    for r in records[1:]:
        start = time.perf_counter()
        replay(replica, [r], config, threads=threads, start_step=r.step)
        replay_samples.append(time.perf_counter() - start)
    replay_step = statistics.median(replay_samples)

    layout = ImageLayout.of(replica)
    buffer = SharedBuffer(layout.nbytes)
    image = layout.views(buffer.bytes)
    snapshot = _median_time(lambda: copy_state(image, replica), repeats)
    del image
    buffer.close()
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
        "snapshot_cost_seconds": (snapshot, "median shadow snapshot copy (host.image.copy_state into shared memory)"),
        "persist_seconds": (persist, "median SnapshotStore.save to a local directory"),
        "checkpoint_save_seconds": (persist, "as persist_seconds: the sync baseline writes the same store"),
        "storage_read_seconds": (read, "median SnapshotStore.load (hashes verified)"),
        "state_copy_seconds": (state_copy, "median async-baseline staging copy (benchmarks.baselines.stage)"),
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
