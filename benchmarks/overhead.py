"""`python -m benchmarks overhead`: the trainer's critical-path cost of publishing a step record.

    python -m benchmarks overhead --json benchmarks/results/overhead.json
    python -m benchmarks overhead --params 1M 10M --json overhead-small.json

For each parameter count (default 1M, 10M, 100M, 1B; bf16 from 1B on, fp32 below)
a state of transformer-like tensors is trained by real `ZOOptimizer.step` calls
(with a trivial closure: the record and its publishing do not depend on the
forward pass), and after every step the record is published exactly as
`Trainer.run` does it: one `deque.append`, timed the same way, while a publishing
thread sends the pending records in batches to a real Ray actor every
`FLUSH_SECONDS`. The append is also timed in a tight loop of `--loop-records`, at
the same memory footprint, for a steady p99. Alongside, in the same run, on a real
local Ray instance:

- one Ray actor call per step: the round trip with the record (right after each
  step, and in a loop) and a fire-and-forget submission alone; what a trainer that
  called its shadow every step would pay;
- the asynchronous checkpoint's critical path: staging a host copy of the state;
- a synchronous full checkpoint (`SnapshotStore.save`) per step.

A last row runs the real `TrainerActor` (tiny-opt, through `controller.run`) and
reports the `publish_us_median` it measures itself. Target: a median below 5 us at
every size (the ZOCheck paper reports 24 us per step), flat: no size's median more
than 1 us above the smallest size's. A 1B-parameter bf16 step takes about a minute
on two cores, so the default run takes about ten minutes there.

Then (`benchmarks.overhead_strategies`) every strategy of the published comparison trains
the same job failure-free on the real `Trainer` (`--strategy-steps`, default 2100) and
its cumulative critical-path checkpointing cost is compared at K = 7, 300, 1000:
zocheck's must be the lowest at every K. From the sizes of 100M parameters on, the
ratio of the async K=1000 baseline's cumulative cost to zocheck's is fitted linearly in
the parameter count and projected to 8B (target >= 200x; the paper measured 219.7x).

JSON (keys stable): {"benchmark": "overhead", "machine", "target_publish_us",
"paper_publish_us", "flush_seconds", "results": [one row per size, see `measure_size`],
"trainer": {model, steps, publish_us_median, trainer_ms_per_step, shadow_equals_trainer} |
None, "strategies": `measure_strategies` document | None, "size_ratio": `size_ratio`
document, "targets": {publish_median_below_target, flat, met, lowest_at_every_k,
ratio_at_8b, ratio_at_8b_met, worst_publish_us_median, best_publish_us_median, growth_us,
spread_us, notes}}.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import ray
import torch

from benchmarks.baselines import PAPER_INTERVALS, stage
from benchmarks.common import bench_job, machine, md_table, print_table, run_command_for_json, write_json
from benchmarks.overhead_strategies import (
    measure_strategies, print_ratio, print_strategies, size_ratio,
)
from benchmarks.replay import make_state
from zocheck_ray.runtime.trainer import FLUSH_SECONDS
from zocheck_ray.core import StepRecord, ZOConfig, ZOOptimizer
from zocheck_ray.storage import SnapshotStore
from zocheck_ray.workload.data import step_seed

TARGET_PUBLISH_US = 5.0
PAPER_PUBLISH_US = 24.0
FLAT_GROWTH_US = 1.0
"""Flat: no size's publish median exceeds the smallest size's by more than this."""
DEFAULT_PARAMS = ["1M", "10M", "100M", "400M", "1B"]
BF16_FROM_PARAMS = 1_000_000_000
"""With `--dtype auto`, sizes from here on are bf16 (a 1B fp32 state and its staging copy need 8 GB)."""
_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}


def parse_count(text: str) -> int:
    """'1M' -> 1_000_000, '2.5B' -> 2_500_000_000, '12345' -> 12345."""
    raw = text.strip().upper().replace("_", "")
    factor = _SUFFIXES.get(raw[-1:], 1)
    try:
        value = int(float(raw[:-1] if factor != 1 else raw) * factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count such as 1000000, 10M or 1B") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the count must be at least 1")
    return value


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = min(len(ordered), max(1, math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def _summary(ns: list[int]) -> dict:
    us = [v / 1e3 for v in ns]
    return {"median": statistics.median(us), "p99": percentile(us, 99), "samples": len(us)}


@ray.remote(num_cpus=0)
class RecordSink:
    """Receives published records (the shadow's inbox, without the replay)."""

    def __init__(self):
        self.received_bytes = 0

    def push(self, data: bytes) -> int:
        self.received_bytes += len(data)
        return self.received_bytes

    def ping(self, data: bytes) -> int:
        return len(data)

    def received(self) -> int:
        return self.received_bytes


class RecordPublisher:
    """The trainer's publishing path (`Trainer.run` and `Trainer.flush`): the loop appends to
    `pending`; a thread encodes and sends what is pending every `FLUSH_SECONDS`, one call per batch."""

    def __init__(self, sink):
        self.sink = sink
        self.pending: deque[StepRecord] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-publish", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(FLUSH_SECONDS):
            self.flush()

    def flush(self) -> None:
        with self._lock:
            parts = []
            while self.pending:
                parts.append(self.pending.popleft().to_bytes())
            if parts:
                self.sink.push.remote(b"".join(parts))

    def close(self) -> int:
        """Stop, send what is left; returns the bytes the sink has received."""
        self._stop.set()
        self._thread.join()
        self.flush()
        return ray.get(self.sink.received.remote())


def _time_ns(fn) -> int:
    start = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - start


def measure_size(params: int, dtype_name: str, sink, storage_dir: str, *, min_steps: int = 3, max_steps: int = 200,
                 step_budget_seconds: float = 20.0, loop_records: int = 20_000, ray_calls: int = 1000,
                 save_repeats: int = 1, copy_repeats: int = 3) -> dict:
    """All figures for one parameter count (see the module docstring)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    state = make_state(params, dtype, "zo-sgd")
    opt = ZOOptimizer(list(state.items()), ZOConfig(lr=1e-6, eps=1e-3))
    first = next(iter(state.values())).view(-1)
    closure = lambda: float(first[0])  # noqa: E731 - a loss that moves with the perturbation
    publisher = RecordPublisher(sink)
    received_before = ray.get(sink.received.remote())
    publish_ns, ray_step_ns, step_seconds = [], [], []
    published = 0
    deadline = time.perf_counter() + step_budget_seconds
    while len(step_seconds) < max_steps and (len(step_seconds) < min_steps or time.perf_counter() < deadline):
        started = time.perf_counter()
        record = opt.step(closure, seed=step_seed(0, opt.step_index))
        step_seconds.append(time.perf_counter() - started)
        start = time.perf_counter_ns()
        publisher.pending.append(record)  # the whole critical-path cost, as in Trainer.run
        publish_ns.append(time.perf_counter_ns() - start)
        published += record.size
        payload = record.to_bytes()
        ray_step_ns.append(_time_ns(lambda: ray.get(sink.ping.remote(payload))))

    # Many more samples of the same append, at this memory footprint, for a steady p99.
    records = [StepRecord(opt.step_index + i, step_seed(0, opt.step_index + i), record.projected_grad, record.lr,
                          record.eps, record.fingerprint) for i in range(loop_records)]
    loop_ns = []
    for r in records:
        start = time.perf_counter_ns()
        publisher.pending.append(r)
        loop_ns.append(time.perf_counter_ns() - start)
        published += r.size
    delivered = publisher.close() - received_before

    payload = record.to_bytes()
    ray_ns = [_time_ns(lambda: ray.get(sink.ping.remote(payload))) for _ in range(ray_calls)]
    submitted = []
    submit_ns = [_time_ns(lambda: submitted.append(sink.ping.remote(payload))) for _ in range(ray_calls)]
    ray.get(submitted)

    staging = stage(state)
    copy_seconds = []
    for _ in range(copy_repeats):
        start = time.perf_counter()
        stage(state, out=staging)
        copy_seconds.append(time.perf_counter() - start)
    del staging
    store_dir = tempfile.mkdtemp(prefix="sync-checkpoint-", dir=storage_dir)
    try:
        store = SnapshotStore(store_dir)
        save_seconds = []
        for i in range(save_repeats):
            start = time.perf_counter()
            store.save(opt.step_index + i, state, {"run_id": "bench-overhead"})
            save_seconds.append(time.perf_counter() - start)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)

    publish, loop = _summary(publish_ns), _summary(loop_ns)
    ray_call, ray_step, submit = _summary(ray_ns), _summary(ray_step_ns), _summary(submit_ns)
    step_median = statistics.median(step_seconds)
    return {
        "params": params, "dtype": dtype_name,
        "state_mb": sum(t.numel() * t.element_size() for t in state.values()) / 2**20,
        "steps": len(step_seconds), "zo_step_ms": step_median * 1e3,
        "publish_us_median": publish["median"], "publish_us_p99": publish["p99"],
        "publish_loop_us_median": loop["median"], "publish_loop_us_p99": loop["p99"], "loop_records": len(loop_ns),
        "ray_call_us_median": ray_call["median"], "ray_call_us_p99": ray_call["p99"],
        "ray_call_in_steps_us_median": ray_step["median"],
        "ray_submit_us_median": submit["median"], "ray_submit_us_p99": submit["p99"],
        "staging_copy_ms": statistics.median(copy_seconds) * 1e3,
        "sync_save_ms": statistics.median(save_seconds) * 1e3,
        "publish_fraction_of_step": publish["median"] / 1e6 / step_median,
        "records_published_bytes": published, "records_delivered_bytes": delivered,
    }


def measure_trainer(steps: int, storage_dir: str) -> dict:
    """The real `TrainerActor` (tiny-opt) through `controller.run`: its own `publish_us_median`."""
    from zocheck_ray.control import run

    job = bench_job(model="tiny-opt", steps=steps, storage=storage_dir, log_interval=max(10, steps // 10))
    summary = run(job, progress=None)
    return {"model": "tiny-opt", "steps": summary.steps, "publish_us_median": summary.publish_us_median,
            "trainer_ms_per_step": summary.trainer_seconds_per_step * 1e3,
            "shadow_equals_trainer": summary.final_state_hash == summary.shadow_state_hash}


def overhead_benchmark(params: list[int], dtype: str = "auto", storage: str | None = None, trainer_steps: int = 1000,
                       json_path: str | None = None, say=print, strategy_steps: int = 2100,
                       strategy_model: str = "tiny-opt", intervals: tuple[int, ...] = PAPER_INTERVALS,
                       **size_options) -> dict:
    """Measure every size, print the table, check the target; returns the JSON document.

    Keys: benchmark, machine, target_publish_us, paper_publish_us, results (one row per size,
    see `measure_size`), trainer (or None), targets {publish_median_below_target, flat, met,
    worst_publish_us_median, best_publish_us_median, growth_us, spread_us, notes}.
    """
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", num_cpus=max(3, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    storage_dir = storage or tempfile.mkdtemp(prefix="zocheck-bench-overhead-")
    info = machine()
    info["load_average_before"] = list(os.getloadavg())
    say(f"overhead benchmark: {', '.join(f'{p:,}' for p in params)} parameters, {info['cpu']}")
    rows, trainer = [], None
    sink = RecordSink.remote()
    try:
        for n in params:
            name = dtype if dtype != "auto" else ("bf16" if n >= BF16_FROM_PARAMS else "fp32")
            say(f"  measuring {n:,} parameters ({name}) ...")
            rows.append(measure_size(n, name, sink, storage_dir, **size_options))
        if trainer_steps:
            say(f"  measuring the real TrainerActor (tiny-opt, {trainer_steps} steps) ...")
            trainer = measure_trainer(trainer_steps, storage_dir)
        strategies = None
        if strategy_steps:
            say(f"  every strategy on the real Trainer ({strategy_model}, {strategy_steps} steps) ...")
            strategies = measure_strategies(strategy_model, strategy_steps, tuple(intervals), storage_dir, say)
    finally:
        ray.kill(sink)
        if storage is None:
            shutil.rmtree(storage_dir, ignore_errors=True)
        if started_ray:
            ray.shutdown()

    say("")
    print_table(rows, [
        ("params", "params", ","), ("dtype", "dtype", ""), ("steps", "steps", "d"), ("zo_step_ms", "ZO step ms", ".1f"),
        ("publish_us_median", "publish us p50", ".2f"), ("publish_us_p99", "p99", ".2f"),
        ("publish_loop_us_median", "loop p50", ".2f"), ("publish_loop_us_p99", "loop p99", ".2f"),
        ("ray_call_us_median", "Ray call us p50", ".0f"), ("ray_call_us_p99", "p99", ".0f"),
        ("ray_call_in_steps_us_median", "after a step", ".0f"), ("ray_submit_us_median", "Ray submit us", ".0f"),
        ("staging_copy_ms", "staging copy ms", ".1f"),
        ("sync_save_ms", "sync save ms", ".0f"),
    ])
    medians = [r["publish_us_median"] for r in rows] + [r["publish_loop_us_median"] for r in rows]
    below = all(m < TARGET_PUBLISH_US for m in medians)
    # Like with like: the appends after real steps (cold caches, the publisher thread waking
    # up beside them) and the tight-loop appends. Flat means no growth with the state's size;
    # the spread (noise from the GIL and the machine's load) is reported beside it.
    by_size = sorted(rows, key=lambda r: r["params"])
    keys = ("publish_us_median", "publish_loop_us_median")
    growth = max(max(r[k] for r in by_size[1:]) - by_size[0][k] for k in keys) if len(by_size) > 1 else 0.0
    spread = max(max(r[k] for r in rows) - min(r[k] for r in rows) for k in keys)
    flat = growth <= FLAT_GROWTH_US
    notes = []
    if trainer is not None:
        say(f"\nreal TrainerActor (tiny-opt, {trainer['steps']} steps): publish median "
            f"{trainer['publish_us_median']:.2f} us, {trainer['trainer_ms_per_step']:.1f} ms per step")
        below = below and trainer["publish_us_median"] < TARGET_PUBLISH_US
    for r in rows:
        if r["records_delivered_bytes"] != r["records_published_bytes"]:
            notes.append(f"{r['params']:,} params: {r['records_delivered_bytes']} of {r['records_published_bytes']} "
                         "record bytes reached the sink")
    for r in rows:
        say(f"  {r['params']:>13,} params: publishing is {r['ray_call_us_median'] / r['publish_us_median']:,.0f}x "
            f"cheaper than a Ray call per step, {r['sync_save_ms'] * 1e3 / r['publish_us_median']:,.0f}x cheaper "
            f"than a synchronous checkpoint per step, {r['staging_copy_ms'] * 1e3 / r['publish_us_median']:,.0f}x "
            "cheaper than staging a host copy")
    ratio = size_ratio(rows)
    if strategies is not None:
        print_strategies(strategies, say)
        lowest = strategies["lowest"]
        say(f"zocheck's cumulative cost is the lowest at every K ({', '.join(map(str, strategies['intervals']))}): "
            f"{'met' if lowest['met'] else 'missed'}")
        if not lowest["met"]:
            notes.append("zocheck's cumulative critical-path cost is not below every checkpointing strategy at "
                         "K = " + ", ".join(k for k, v in lowest["by_k"].items() if v["met"] is False))
        for v in lowest["by_k"].values():
            if v.get("note"):
                say(f"  {v['note']}")
        if not strategies["final_states_equal"]:
            notes.append("the strategies did not all train the same final state")
    print_ratio(ratio, say)
    if ratio["sizes"] and not ratio["met"]:
        notes.append(f"projected zocheck/async K={ratio['every']} ratio at 8B is "
                     f"{ratio['projected_ratio'] or 0:.0f}x, below {ratio['target']:g}x"
                     + ("" if ratio["fit"] else " (fewer than two sizes of at least 100M parameters)"))
    worst = max(medians)
    if not below:
        notes.insert(0, f"worst publish median {worst:.2f} us is not below {TARGET_PUBLISH_US:g} us")
    if not flat:
        notes.append(f"the publish median grows by up to {growth:.2f} us above the {by_size[0]['params']:,}-parameter "
                     f"one (flat: <= {FLAT_GROWTH_US:g} us)")
    met = below and flat and not notes
    if met:
        say(f"\ntarget met: publish median <= {worst:.2f} us at every size (target < {TARGET_PUBLISH_US:g} us; the "
            f"paper reports {PAPER_PUBLISH_US:g} us); flat from {by_size[0]['params']:,} to {by_size[-1]['params']:,} "
            f"parameters (growth {growth:+.2f} us, spread {spread:.2f} us)")
    else:
        say("\ntarget missed: " + "; ".join(notes))
    info["load_average_after"] = list(os.getloadavg())
    doc = {
        "benchmark": "overhead", "machine": info, "target_publish_us": TARGET_PUBLISH_US,
        "paper_publish_us": PAPER_PUBLISH_US, "flush_seconds": FLUSH_SECONDS, "results": rows, "trainer": trainer,
        "strategies": strategies, "size_ratio": ratio,
        "targets": {"publish_median_below_target": below, "flat": flat, "met": met,
                    "lowest_at_every_k": strategies["lowest"]["met"] if strategies else None,
                    "ratio_at_8b": ratio["projected_ratio"], "ratio_at_8b_met": ratio["met"] if ratio["sizes"] else None,
                    "worst_publish_us_median": worst, "best_publish_us_median": min(medians),
                    "growth_us": growth, "spread_us": spread, "notes": notes},
    }
    write_json(json_path, doc)
    return doc


def run(args: argparse.Namespace) -> int:
    options = dict(min_steps=args.min_steps, max_steps=args.max_steps, step_budget_seconds=args.step_seconds,
                   loop_records=args.loop_records, ray_calls=args.ray_calls, save_repeats=args.save_repeats)
    doc = overhead_benchmark(args.params, args.dtype, args.storage, args.trainer_steps, args.json,
                             strategy_steps=args.strategy_steps, strategy_model=args.strategy_model,
                             intervals=tuple(args.intervals), **options)
    return 0 if doc["targets"]["met"] else 1


# ------------------------------------------------------------ in `bench all`: options, tables, figures, verdicts

SUITE_ARGS = {
    "quick": ["--params", "1M", "10M", "--min-steps", "2", "--max-steps", "3", "--step-seconds", "1",
              "--loop-records", "2000", "--ray-calls", "100", "--trainer-steps", "100"],
    "full": [],
}
"""Command-line arguments of `bench all`'s run (`--quick` or not)."""


def run_in_suite(out: Path, quick: bool) -> dict:
    """`bench all`'s run: through the command line, so its defaults and checks apply; the JSON in `out`."""
    return run_command_for_json(register, "overhead", SUITE_ARGS["quick" if quick else "full"], out / "overhead.json")


def markdown(doc: dict) -> str:
    rows = doc.get("results", [])
    targets = doc.get("targets", {})
    return "\n".join([
        "# Critical-path overhead\n",
        md_table(rows, [("params", "params", ","), ("dtype", "dtype", ""), ("zo_step_ms", "ZO step ms", ".1f"),
                        ("publish_us_median", "publish us p50", ".2f"), ("publish_us_p99", "p99", ".2f"),
                        ("ray_call_us_median", "Ray call us", ".0f"), ("staging_copy_ms", "staging copy ms", ".1f"),
                        ("sync_save_ms", "sync save ms", ".0f")]),
        f"\nTargets met: {targets.get('met')}. " + " ".join(targets.get("notes", [])) + "\n"])


def verdicts(doc: dict) -> list[str]:
    """The summary's lines for this benchmark's targets."""
    targets = doc.get("targets", {})
    return [f"targets met: {targets.get('met')}"] + [f"note: {n}" for n in targets.get("notes", [])]


def register(bench) -> None:
    parser = bench.add_parser("overhead", help="critical-path cost of publishing a step record, 1M to 1B parameters",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", nargs="+", type=parse_count, default=[parse_count(p) for p in DEFAULT_PARAMS],
                        metavar="N", help="parameter counts, e.g. 1M 10M 100M 1B (the default)")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                        help=f"parameter dtype; auto: bf16 from {BF16_FROM_PARAMS:,} parameters on, else fp32")
    parser.add_argument("--min-steps", type=int, default=3, help="real ZO steps per size, at least (default 3)")
    parser.add_argument("--max-steps", type=int, default=200, help="real ZO steps per size, at most (default 200)")
    parser.add_argument("--step-seconds", type=float, default=20.0,
                        help="time per size for real steps beyond --min-steps (default 20)")
    parser.add_argument("--loop-records", type=int, default=20_000,
                        help="extra timed appends per size, for a steady p99 (default 20000)")
    parser.add_argument("--ray-calls", type=int, default=1000, help="timed Ray calls per size (default 1000)")
    parser.add_argument("--save-repeats", type=int, default=1, help="synchronous checkpoint saves per size (default 1)")
    parser.add_argument("--trainer-steps", type=int, default=1000,
                        help="steps of the real TrainerActor row (0 skips it; default 1000)")
    parser.add_argument("--strategy-steps", type=int, default=2100,
                        help="steps of the failure-free run under every strategy (0 skips it; default 2100)")
    parser.add_argument("--strategy-model", default="tiny-opt", help="model of that run (default tiny-opt)")
    parser.add_argument("--intervals", type=int, nargs="+", default=list(PAPER_INTERVALS),
                        help="the checkpoint intervals K of the sync and async baselines (default 7 300 1000)")
    parser.add_argument("--storage", metavar="DIR", help="where checkpoints are written (default: a temporary dir)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.set_defaults(func=run)
