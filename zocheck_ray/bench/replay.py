"""`zocheck-ray bench replay`: the fused replay against eager torch and the memory bandwidth.

    zocheck-ray bench replay --params 20000000 --dtype fp32 bf16 --json replay.json

For each dtype and optimizer, in one run on one state:
- fused: `zocheck_ray.replay`, one record per call (how a shadow keeping pace
  replays) and a batch of records per call (how it catches up);
- eager: a MeZO-style replay in eager torch, as published systems replay: z is
  regenerated with torch's generator four times per step (three perturbations
  and the update), each operation a separate pass over the parameters;
- bandwidth limit: the fastest of one read plus one write of the parameter bytes
  (an in-place scale with the same threads, and torch's copy).
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
import torch
from numba import njit, prange

from zocheck_ray.bench.common import best_seconds, machine, print_table, write_json
from zocheck_ray.core import StepRecord, ZOConfig, replay
from zocheck_ray.core.layout import EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, Layout, applies_weight_decay

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TENSOR_COLUMNS = 4096


def make_state(params: int, dtype: torch.dtype, optimizer: str) -> dict[str, torch.Tensor]:
    """Transformer-like tensors of up to 4M elements (plus one 1-D tensor), `params` in all."""
    state, left, i = {}, params, 0
    gen = torch.Generator().manual_seed(0)
    while left > 0:
        rows = min(1024, max(1, left // TENSOR_COLUMNS))
        shape = (rows, TENSOR_COLUMNS) if left >= TENSOR_COLUMNS else (left,)
        state[f"layers.{i}.weight" if len(shape) == 2 else f"layers.{i}.bias"] = (
            torch.randn(shape, generator=gen).mul_(0.02).to(dtype))
        left -= state[list(state)[-1]].numel()
        i += 1
    if optimizer == "zo-adam":
        names = list(state)
        for prefix in (EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX):
            for n in names:
                state[prefix + n] = torch.zeros(state[n].shape, dtype=torch.float32)
    return state


def make_records(state, config: ZOConfig, count: int, first: int = 0) -> list[StepRecord]:
    layout = Layout.from_state(state, config)
    fp = layout.fingerprint(config)
    extras = tuple(0.02 for _ in layout.params) if config.optimizer == "sparse-mezo" else ()
    rng = np.random.default_rng(first)
    return [StepRecord(first + t, int(rng.integers(0, 2**63)), float(rng.normal()), config.lr, config.eps, fp,
                       config.optimizer, extras) for t in range(count)]


# ------------------------------------------------------------------ the eager baseline


def eager_mezo_replay(params: dict[str, torch.Tensor], moments, records, config: ZOConfig) -> None:
    """A MeZO-style eager replay: regenerate z with torch's generator for every pass."""
    for r in records:
        for scale in (1.0, -2.0, 1.0):
            torch.manual_seed(r.seed % 2**63)
            for name, p in params.items():
                z = torch.normal(mean=0.0, std=1.0, size=p.shape, dtype=p.dtype)
                p.copy_(p + scale * z * r.eps)
        torch.manual_seed(r.seed % 2**63)
        for name, p in params.items():
            z = torch.normal(mean=0.0, std=1.0, size=p.shape, dtype=p.dtype)
            grad = r.projected_grad * z
            if config.optimizer == "zo-adam":
                m, v = moments[name]
                b1, b2 = config.betas
                m.mul_(b1).add_((1 - b1) * grad)
                v.mul_(b2).add_((1 - b2) * grad * grad)
                t = r.step + 1
                update = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + config.adam_eps)
                p.copy_(p - r.lr * update.to(p.dtype))
            elif applies_weight_decay(name, tuple(p.shape)):
                p.copy_(p - r.lr * (grad + config.weight_decay * p))
            else:
                p.copy_(p - r.lr * grad)


# ------------------------------------------------------------------ the bandwidth limit


@njit(parallel=True, cache=True)
def _scale_in_place(x, factor):
    n = x.shape[0]
    parts = 64
    for c in prange(parts):
        for i in range(c * n // parts, (c + 1) * n // parts):
            x[i] = x[i] * factor


def bandwidth_limit_seconds(nbytes: int, threads: int) -> float:
    """Fastest one read plus one write of `nbytes` (in-place scale; torch copy)."""
    words = np.ones(nbytes // 4, dtype=np.float32)
    previous = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        _scale_in_place(words, np.float32(1.0))
        in_place = best_seconds(lambda: _scale_in_place(words, np.float32(1.0)), repeats=5)
    finally:
        numba.set_num_threads(previous)
    src = torch.from_numpy(words)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy = best_seconds(lambda: dst.copy_(src), repeats=5)
    return min(in_place, copy)


# ------------------------------------------------------------------ the benchmark


def bench_one(params: int, dtype_name: str, optimizer: str, threads: int, steps: int, eager_steps: int) -> dict:
    dtype = DTYPES[dtype_name]
    config = ZOConfig(optimizer=optimizer, lr=1e-6, eps=1e-3, weight_decay=0.01 if optimizer != "zo-adam" else 0.0)
    state = make_state(params, dtype, optimizer)
    records = make_records(state, config, 1 + 2 * steps)
    replay(state, records[:1], config, threads=threads)  # compile or load the kernel
    start = time.perf_counter()
    for r in records[1 : 1 + steps]:
        replay(state, [r], config, threads=threads)
    streaming = (time.perf_counter() - start) / steps
    start = time.perf_counter()
    replay(state, records[1 + steps :], config, threads=threads)
    batched = (time.perf_counter() - start) / steps

    param_names = [n for n in state if not n.startswith("optimizer.")]
    eager_params = {n: state[n].clone() for n in param_names}
    moments = {n: (torch.zeros(state[n].shape), torch.zeros(state[n].shape)) for n in param_names}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        eager_mezo_replay(eager_params, moments, records[:1], config)  # warm-up
        start = time.perf_counter()
        eager_mezo_replay(eager_params, moments, records[1 : 1 + eager_steps], config)
        eager = (time.perf_counter() - start) / eager_steps
    finally:
        torch.set_num_threads(previous)

    nbytes = sum(state[n].numel() * state[n].element_size() for n in param_names)
    limit = bandwidth_limit_seconds(nbytes, threads)
    return {
        "dtype": dtype_name, "optimizer": optimizer, "params": params, "threads": threads,
        "fused_step_seconds": streaming, "fused_batched_step_seconds": batched, "batch": steps,
        "eager_step_seconds": eager, "bandwidth_limit_seconds": limit,
        "params_per_second_per_thread": params / streaming / threads,
        "speedup_over_eager": eager / streaming,
        "bandwidth_fraction": limit / streaming,
        "bandwidth_fraction_batched": limit / batched,
    }


def run(args: argparse.Namespace) -> int:
    if args.params < 1:
        raise SystemExit("--params must be at least 1")
    threads = args.threads or numba.config.NUMBA_NUM_THREADS
    if not 1 <= threads <= numba.config.NUMBA_NUM_THREADS:
        raise SystemExit(f"--threads must be in [1, {numba.config.NUMBA_NUM_THREADS}], got {threads}")
    info = machine()
    print(f"replay benchmark: {args.params:,} parameters, {threads} threads, {info['cpu']}")
    rows = []
    for dtype_name in args.dtype:
        for optimizer in args.optimizer:
            print(f"  measuring {dtype_name} {optimizer} ...", flush=True)
            rows.append(bench_one(args.params, dtype_name, optimizer, threads, args.steps, args.eager_steps))
    for row in rows:
        row["fused_ms"] = row["fused_step_seconds"] * 1e3
        row["batched_ms"] = row["fused_batched_step_seconds"] * 1e3
        row["eager_ms"] = row["eager_step_seconds"] * 1e3
        row["limit_ms"] = row["bandwidth_limit_seconds"] * 1e3
        row["mps_thread"] = row["params_per_second_per_thread"] / 1e6
    print()
    print_table(rows, [
        ("dtype", "dtype", ""), ("optimizer", "optimizer", ""), ("fused_ms", "fused ms/step", ".1f"),
        ("batched_ms", "batched ms/step", ".1f"), ("eager_ms", "eager ms/step", ".0f"),
        ("mps_thread", "M params/s/thread", ".0f"), ("speedup_over_eager", "x eager", ".1f"),
        ("limit_ms", "1R+1W ms", ".1f"), ("bandwidth_fraction", "of bandwidth", ".0%"),
        ("bandwidth_fraction_batched", "batched", ".0%"),
    ])
    ratios = {}
    for dtype_name in args.dtype:
        by_opt = {r["optimizer"]: r for r in rows if r["dtype"] == dtype_name}
        if "zo-sgd" in by_opt and "zo-adam" in by_opt:
            ratios[dtype_name] = by_opt["zo-adam"]["fused_step_seconds"] / by_opt["zo-sgd"]["fused_step_seconds"]
            print(f"\nzo-adam / zo-sgd replay time ({dtype_name}): {ratios[dtype_name]:.2f}x")
    write_json(args.json, {"benchmark": "replay", "machine": info, "results": rows, "adam_over_sgd": ratios})
    return 0


def register(commands, bench) -> None:
    parser = bench.add_parser("replay", help="fused replay vs eager torch vs memory bandwidth",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=20_000_000, help="parameters (default 20M)")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--optimizer", nargs="+", choices=["zo-sgd", "zo-adam", "sparse-mezo"],
                        default=["zo-sgd", "zo-adam"])
    parser.add_argument("--threads", type=int, default=None, help="replay threads (default: all cores)")
    parser.add_argument("--steps", type=int, default=8, help="timed fused steps (default 8)")
    parser.add_argument("--eager-steps", type=int, default=2, help="timed eager steps (default 2)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.set_defaults(func=run)
