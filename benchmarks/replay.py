"""`python -m benchmarks replay`: the fused replay against eager torch and the memory bandwidth.

    python -m benchmarks replay --params 20000000 --dtype fp32 bf16 --json replay.json

For each dtype and optimizer, on one state, in interleaved rounds (so a loaded
machine slows every contender alike; each figure is the best of its rounds):
- fused: `zocheck_ray.replay`, one record per call (how a shadow keeping pace
  replays) and a batch of records per call (how it catches up);
- eager: a MeZO-style replay in eager torch, as published systems replay: z is
  regenerated with torch's generator four times per step (three perturbations
  and the update), each operation a separate pass over the parameters;
- bandwidth limit: the fastest of one read plus one write of the parameter bytes
  (an in-place scale with the same threads, and torch's copy);
- generator: the perturbation alone (Philox words and their transform into z, in
  cache, nothing read or written in memory) for every parameter, same threads.
  The replay cannot be faster than this, so `limit / generator` is the highest
  fraction of the bandwidth limit the replay can reach with this generator.

The targets are checked against the measured figures and printed as met or not met,
with the load average before and after:
- fused >= 20x eager, for fp32 and bf16;
- fp32: the replay's speed against its ceiling, the slower of the memory traffic and
  the generator. Where one read plus one write is the slower (memory-bound), the
  replay must reach >= 50% of the bandwidth limit. Where the generator alone takes
  longer than the memory traffic (generator-bound: two cores and Philox4x32-10), no
  replay can reach 50% of the bandwidth limit, so that target is retired there and the
  replay must instead reach >= 80% of what the generator allows (generator time /
  replay time >= 0.8). Both fractions are reported either way;
- ZO-Adam within 2.5x of ZO-SGD.
"""

from __future__ import annotations

import argparse
import os
import time

import numba
import numpy as np
import torch
from numba import njit, prange

from benchmarks.common import machine, print_table, write_json
from zocheck_ray.core.dtypes import JOB_DTYPES
from zocheck_ray.core import StepRecord, ZOConfig, replay
from zocheck_ray.core.fused import perturbation_block
from zocheck_ray.core.layout import Layout, applies_weight_decay, moment_prefixes
from zocheck_ray.core.scalars import StepScalars
from zocheck_ray.core.seeds import perturbation_seeds

DTYPES = JOB_DTYPES
TENSOR_COLUMNS = 4096
SPEEDUP_TARGET = 20.0
BANDWIDTH_TARGET = 0.5
"""Memory-bound machines: the replay reaches this fraction of one read plus one write."""
CEILING_TARGET = 0.8
"""Generator-bound machines: the replay reaches this fraction of the speed the generator alone allows."""
ADAM_OVER_SGD_TARGET = 2.5


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
    names = list(state)
    for prefix in moment_prefixes(optimizer):
        for n in names:
            state[prefix + n] = torch.zeros(state[n].shape, dtype=torch.float32)
    return state


def make_records(state, config: ZOConfig, count: int, first: int = 0) -> list[StepRecord]:
    layout = Layout.from_state(state, config)
    fp = layout.fingerprint(config)
    extras = tuple(0.02 for _ in layout.params) if config.optimizer == "sparse-mezo" else ()
    rng = np.random.default_rng(first)
    q = config.num_perturbations
    cons = config.optimizer == "zo-sgd-cons"
    return [StepRecord(first + t, int(rng.integers(0, 2**63)), float(rng.normal()), config.lr, config.eps, fp,
                       config.optimizer, extras, tuple(float(g) for g in rng.normal(size=q - 1)),
                       (first + t) % 3 if cons else 0) for t in range(count)]


# ------------------------------------------------------------------ the eager baseline


def eager_mezo_replay(params: dict[str, torch.Tensor], moments, records, config: ZOConfig) -> None:
    """A MeZO-style eager replay (ZO-Bench's for its optimizers): regenerate z with torch's generator for
    every pass (three perturbations per perturbation, then each update pass; ZO-SGD-Cons makes its moves
    as ZO-Bench's trainer does, one pass each)."""
    for r in records:
        seeds = perturbation_seeds(r.seed, len(r.grads))
        for seed in seeds:
            for scale in (1.0, -2.0, 1.0):
                torch.manual_seed(seed % 2**63)
                for name, p in params.items():
                    z = torch.normal(mean=0.0, std=1.0, size=p.shape, dtype=p.dtype)
                    p.copy_(p + scale * z * r.eps)
        moves = StepScalars.of(r, config).moves if config.optimizer == "zo-sgd-cons" else (r.lr,)
        for move in moves:
            _eager_update(params, moments, r, config, seeds, move)


def _eager_update(params, moments, r: StepRecord, config: ZOConfig, seeds, lr: float) -> None:
    for name, p in params.items():
        grad = None
        for seed, g in zip(seeds, r.grads):
            torch.manual_seed(seed % 2**63)  # as MeZO regenerates it: one generator pass per tensor
            z = torch.normal(mean=0.0, std=1.0, size=p.shape, dtype=p.dtype)
            grad = g / len(seeds) * z if grad is None else grad + g / len(seeds) * z
        if True:
            if config.optimizer == "zo-sgd-sign":
                grad = grad.sign()
            if config.optimizer == "zo-sgd-mmt":
                m = moments[name][0]
                m.mul_(config.momentum).add_(grad.float())
                grad = m.to(p.dtype)
            if config.optimizer == "zo-adam":
                m, v = moments[name]
                b1, b2 = config.betas
                m.mul_(b1).add_((1 - b1) * grad)
                v.mul_(b2).add_((1 - b2) * grad * grad)
                t = r.step + 1
                update = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + config.adam_eps)
                p.copy_(p - lr * update.to(p.dtype))
            elif applies_weight_decay(name, tuple(p.shape)):
                p.copy_(p - lr * (grad + config.weight_decay * p))
            else:
                p.copy_(p - lr * grad)


# ------------------------------------------------------------------ the limits


@njit(parallel=True, cache=True)
def _scale_in_place(x, factor):
    n = x.shape[0]
    parts = 64
    for c in prange(parts):
        for i in range(c * n // parts, (c + 1) * n // parts):
            x[i] = x[i] * factor


@njit(parallel=True, cache=True, error_model="numpy", nogil=True)
def _generate_in_cache(key0, key1, numel, gaussian, chunk):
    """z for elements 0 .. numel-1, chunk by chunk into cache-resident scratch (then dropped)."""
    chunks = (numel + chunk - 1) // chunk
    firsts = np.empty(chunks, np.float32)
    for c in prange(chunks):
        count = (min(chunk, numel - c * chunk) + 3) // 4
        z = np.empty(4 * count, np.float32)
        wa = np.empty(2 * count, np.uint32)
        wb = np.empty(2 * count, np.uint32)
        radius = np.empty(2 * count, np.float32)
        perturbation_block(key0, key1, (c * chunk) >> 2, count, gaussian, z, wa, wb, radius)
        firsts[c] = z[0]
    return firsts


class Limits:
    """The memory-bandwidth limit and the generator-alone time for `params` elements."""

    def __init__(self, params: int, nbytes: int, threads: int, gaussian: bool | None = None):
        """`gaussian`: the perturbation kind `generator_seconds` measures (None: not measured)."""
        self.params, self.threads, self.gaussian = params, threads, gaussian
        self.words = np.ones(nbytes // 4, dtype=np.float32)
        self.src = torch.from_numpy(self.words)
        self.dst = torch.empty_like(self.src)
        self._with_threads(lambda: _scale_in_place(self.words, np.float32(1.0)))
        self.dst.copy_(self.src)
        if gaussian is not None:
            self._with_threads(self._generate)

    def _with_threads(self, fn):
        previous = numba.get_num_threads()
        numba.set_num_threads(self.threads)
        try:
            return fn()
        finally:
            numba.set_num_threads(previous)

    def _generate(self):
        from zocheck_ray.core.fused import CHUNK_ELEMENTS

        _generate_in_cache(np.uint64(12345), np.uint64(678), self.params, self.gaussian, CHUNK_ELEMENTS)

    def bandwidth_seconds(self) -> float:
        """One read plus one write of the bytes: the faster of an in-place scale and a copy."""
        in_place = self._with_threads(lambda: _timed(lambda: _scale_in_place(self.words, np.float32(1.0))))
        copy = _timed(lambda: self.dst.copy_(self.src))
        return min(in_place, copy)

    def generator_seconds(self) -> float:
        return self._with_threads(lambda: _timed(self._generate))


def bandwidth_limit_seconds(nbytes: int, threads: int, repeats: int = 5) -> float:
    """Fastest one read plus one write of `nbytes` (in-place scale; torch copy)."""
    limits = Limits(nbytes // 4, nbytes, threads)
    return min(limits.bandwidth_seconds() for _ in range(repeats))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ------------------------------------------------------------------ the benchmark


def bench_one(params: int, dtype_name: str, optimizer: str, perturbation: str, threads: int, steps: int,
              eager_steps: int, rounds: int, num_perturbations: int = 1) -> dict:
    dtype = DTYPES[dtype_name]
    config = ZOConfig(optimizer=optimizer, perturbation=perturbation, lr=1e-6, eps=1e-3,
                      weight_decay=0.01 if optimizer != "zo-adam" else 0.0, num_perturbations=num_perturbations)
    state = make_state(params, dtype, optimizer)
    records = make_records(state, config, 1 + rounds * (2 * steps + eager_steps))
    start = time.perf_counter()
    replay(state, records[:1], config, threads=threads, start_step=records[0].step)  # compile, or load the compiled kernel
    first_call = time.perf_counter() - start

    param_names = [n for n in state if not n.startswith("optimizer.")]
    eager_params = {n: state[n].clone() for n in param_names}
    moments = {n: (torch.zeros(state[n].shape), torch.zeros(state[n].shape)) for n in param_names}
    nbytes = sum(state[n].numel() * state[n].element_size() for n in param_names)
    limits = Limits(params, nbytes, threads, perturbation == "gaussian")
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        eager_mezo_replay(eager_params, moments, records[:1], config)  # warm-up
        best = {"stream": np.inf, "batched": np.inf, "eager": np.inf, "limit": np.inf, "generator": np.inf}
        next_record = 1
        for _ in range(rounds):
            for r in records[next_record : next_record + steps]:
                best["stream"] = min(best["stream"], _timed(lambda: replay(state, [r], config, threads=threads, start_step=r.step)))
            next_record += steps
            batch = records[next_record : next_record + steps]
            best["batched"] = min(best["batched"], _timed(lambda: replay(state, batch, config, threads=threads, start_step=batch[0].step)) / steps)
            next_record += steps
            eager = records[next_record : next_record + eager_steps]
            best["eager"] = min(best["eager"],
                                _timed(lambda: eager_mezo_replay(eager_params, moments, eager, config)) / eager_steps)
            next_record += eager_steps
            # the short measurements are repeated within a round, a preempted one being common
            best["limit"] = min(best["limit"], *(limits.bandwidth_seconds() for _ in range(steps)))
            best["generator"] = min(best["generator"], *(limits.generator_seconds() for _ in range(3)))
    finally:
        torch.set_num_threads(torch_threads)

    per_thread_ns = 1e9 * threads / params
    return {
        "dtype": dtype_name, "optimizer": optimizer, "perturbation": perturbation, "params": params,
        "num_perturbations": num_perturbations,
        "threads": threads, "rounds": rounds, "batch": steps,
        "first_call_seconds": first_call,
        "fused_step_seconds": best["stream"], "fused_batched_step_seconds": best["batched"],
        "eager_step_seconds": best["eager"], "bandwidth_limit_seconds": best["limit"],
        "generator_seconds": best["generator"],
        "params_per_second_per_thread": params / best["stream"] / threads,
        "ns_per_element_per_thread": best["stream"] * per_thread_ns,
        "batched_ns_per_element_per_thread": best["batched"] * per_thread_ns,
        "generator_ns_per_element_per_thread": best["generator"] * per_thread_ns,
        "limit_ns_per_element_per_thread": best["limit"] * per_thread_ns,
        "speedup_over_eager": best["eager"] / best["stream"],
        "bandwidth_fraction": best["limit"] / best["stream"],
        "bandwidth_fraction_batched": best["limit"] / best["batched"],
        "generator_bound_fraction": best["limit"] / best["generator"],
        "ceiling_fraction": max(best["limit"], best["generator"]) / best["stream"],
        "ceiling_fraction_batched": max(best["limit"], best["generator"]) / best["batched"],
        "generator_bound": best["generator"] > best["limit"],
    }


def ceiling_target(row: dict) -> dict:
    """The fp32 speed target of one row: against the bandwidth limit where memory traffic bounds the
    replay, against the generator-bound ceiling where the generator alone costs more.

    `row` needs `bandwidth_limit_seconds`, `generator_seconds` and `fused_step_seconds`.
    """
    limit, generator, fused = row["bandwidth_limit_seconds"], row["generator_seconds"], row["fused_step_seconds"]
    of_limit, of_ceiling, allows = limit / fused, max(limit, generator) / fused, limit / generator
    name = f"{row['dtype']} {row['optimizer']} {row['perturbation']}"
    measured = (f"{of_limit:.0%} of the bandwidth limit, {of_ceiling:.0%} of the ceiling "
                f"(the generator alone allows {allows:.0%} of the limit)")
    if generator > limit:
        return {"target": f"{name}: >= {CEILING_TARGET:.0%} of the generator-bound ceiling (generator-bound: "
                          f"the {BANDWIDTH_TARGET:.0%}-of-bandwidth target is retired here)",
                "measured": measured, "met": of_ceiling >= CEILING_TARGET, "bound": "generator"}
    return {"target": f"{name}: >= {BANDWIDTH_TARGET:.0%} of the bandwidth limit (memory-bound)",
            "measured": measured, "met": of_limit >= BANDWIDTH_TARGET, "bound": "memory"}


def check_targets(rows: list[dict], ratios: dict[str, float]) -> list[dict]:
    """Each target against the measured rows: what was asked, what was measured, met or not."""
    targets = []
    for row in rows:
        name = f"{row['dtype']} {row['optimizer']} {row['perturbation']}"
        if row["dtype"] in ("fp32", "bf16"):
            targets.append({"target": f"{name}: fused >= {SPEEDUP_TARGET:.0f}x eager",
                            "measured": f"{row['speedup_over_eager']:.1f}x",
                            "met": row["speedup_over_eager"] >= SPEEDUP_TARGET})
        if row["dtype"] == "fp32":
            targets.append(ceiling_target(row))
    for dtype_name, ratio in ratios.items():
        targets.append({"target": f"{dtype_name}: zo-adam within {ADAM_OVER_SGD_TARGET}x of zo-sgd",
                        "measured": f"{ratio:.2f}x", "met": ratio <= ADAM_OVER_SGD_TARGET})
    return targets


def run(args: argparse.Namespace) -> int:
    if args.params < 1:
        raise SystemExit("--params must be at least 1")
    if args.steps < 1 or args.eager_steps < 1 or args.rounds < 1:
        raise SystemExit("--steps, --eager-steps and --rounds must be at least 1")
    threads = args.threads or numba.config.NUMBA_NUM_THREADS
    if not 1 <= threads <= numba.config.NUMBA_NUM_THREADS:
        raise SystemExit(f"--threads must be in [1, {numba.config.NUMBA_NUM_THREADS}], got {threads}")
    info = machine()
    load_before = os.getloadavg()
    print(f"replay benchmark: {args.params:,} parameters, {threads} threads, {info['cpu']}, "
          f"load average {load_before[0]:.2f}")
    rows = []
    for dtype_name in args.dtype:
        for optimizer in args.optimizer:
            print(f"  measuring {dtype_name} {optimizer} {args.perturbation} ...", flush=True)
            rows.append(bench_one(args.params, dtype_name, optimizer, args.perturbation, threads, args.steps,
                                  args.eager_steps, args.rounds, args.num_perturbations))
    load_after = os.getloadavg()
    for row in rows:
        row["fused_ms"] = row["fused_step_seconds"] * 1e3
        row["batched_ms"] = row["fused_batched_step_seconds"] * 1e3
        row["eager_ms"] = row["eager_step_seconds"] * 1e3
        row["limit_ms"] = row["bandwidth_limit_seconds"] * 1e3
        row["generator_ms"] = row["generator_seconds"] * 1e3
        row["mps_thread"] = row["params_per_second_per_thread"] / 1e6
    print()
    print_table(rows, [
        ("dtype", "dtype", ""), ("optimizer", "optimizer", ""), ("fused_ms", "fused ms/step", ".1f"),
        ("batched_ms", "batched ms/step", ".1f"), ("eager_ms", "eager ms/step", ".0f"),
        ("ns_per_element_per_thread", "ns/elem/thread", ".2f"),
        ("mps_thread", "M params/s/thread", ".0f"), ("speedup_over_eager", "x eager", ".1f"),
        ("limit_ms", "1R+1W ms", ".1f"), ("bandwidth_fraction", "of bandwidth", ".0%"),
        ("bandwidth_fraction_batched", "batched", ".0%"),
        ("generator_ms", "generator ms", ".1f"), ("generator_bound_fraction", "generator allows", ".0%"),
        ("ceiling_fraction", "of ceiling", ".0%"),
    ])
    print("\ngenerator: Philox words and their transform alone, in cache, for every parameter (the replay's "
          "compute floor);\n'generator allows' = 1R+1W / generator: the highest fraction of the bandwidth limit "
          "a replay with this generator can reach;\n'of ceiling' = max(1R+1W, generator) / fused: how close the "
          "replay comes to the slower of the two, what it is judged against where the generator is the slower.")
    ratios = {}
    for dtype_name in args.dtype:
        by_opt = {r["optimizer"]: r for r in rows if r["dtype"] == dtype_name}
        if "zo-sgd" in by_opt and "zo-adam" in by_opt:
            ratios[dtype_name] = by_opt["zo-adam"]["fused_step_seconds"] / by_opt["zo-sgd"]["fused_step_seconds"]
            print(f"zo-adam / zo-sgd replay time ({dtype_name}): {ratios[dtype_name]:.2f}x")
    targets = check_targets(rows, ratios)
    print("\ntargets:")
    for t in targets:
        print(f"  {'met    ' if t['met'] else 'NOT MET'}  {t['target']}: {t['measured']}")
    print(f"\nload average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f} on {info['cpu_count']} CPUs; "
          f"each figure is the best of {args.rounds} interleaved rounds")
    write_json(args.json, {"benchmark": "replay", "machine": info, "results": rows, "adam_over_sgd": ratios,
                           "targets": targets, "load_average_before": load_before, "load_average_after": load_after})
    return 0


def register(bench) -> None:
    parser = bench.add_parser("replay", help="fused replay vs eager torch vs memory bandwidth",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=20_000_000, help="parameters (default 20M)")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--num-perturbations", type=int, default=1,
                        help="q: perturbations per step (n-SPSA), each record carrying q projected gradients")
    parser.add_argument("--optimizer", nargs="+", choices=["zo-sgd", "zo-adam", "sparse-mezo", "zo-sgd-sign",
                                                        "zo-sgd-mmt", "zo-sgd-cons"],
                        default=["zo-sgd", "zo-adam"])
    parser.add_argument("--perturbation", choices=["gaussian", "rademacher"], default="gaussian",
                        help="perturbation kind (default gaussian)")
    parser.add_argument("--threads", type=int, default=None, help="replay threads (default: all cores)")
    parser.add_argument("--steps", type=int, default=8, help="fused steps timed per round (default 8)")
    parser.add_argument("--eager-steps", type=int, default=1, help="eager steps timed per round (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; figures are the best (default 3)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.set_defaults(func=run)
