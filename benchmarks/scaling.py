"""`python -m benchmarks scaling`: replay time against parameter count, threads and dtype, and
its independence from batch size and sequence length.

    python -m benchmarks scaling --json benchmarks/results/scaling.json
    python -m benchmarks scaling --params 1M 4M --threads 1 2 --dtype fp32 bf16 --json scaling-small.json

Part 1, the grid: for every parameter count, thread count and dtype, the fused replay
(`zocheck_ray.core.replay`) of one record on a transformer-like state, the fastest of
`--repeats` (the least disturbed on a shared machine); the baseline, measured in the same run at each size, is one read plus one
write of the state's bytes (`benchmarks.replay.bandwidth_limit_seconds`), which no replay of
a state held in memory can beat. A line fitted per (dtype, threads) gives seconds per
parameter; the table shows how far each point is from it.

Part 2, batch size and sequence length: an OPT built from a config is trained for real
at every (batch size, sequence length); the trainer's step runs two forward passes over
the batch, so its time grows with batch x length. Each step's record is replayed on a
copy of the state (and timed on a scratch copy, fastest of 5): a record is a seed and a
scalar, replay runs no forward pass, so its time does not move. Both columns are the
fastest over the steps; the table shows both, with the spread (max / min) of each.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numba
import numpy as np
import torch

from benchmarks.common import best_seconds, machine, md_table, print_table, pyplot, write_json
from benchmarks.replay import DTYPES, bandwidth_limit_seconds, make_records, make_state
from zocheck_ray.core import ZOConfig, ZOOptimizer, replay

DEFAULT_PARAMS = ["1M", "4M", "16M", "64M"]
DEFAULT_BATCHES = [1, 4, 16]
DEFAULT_SEQ_LENS = [16, 64, 256]
REPLAY_REPEATS = 5
"""Timed replays of each record in part 2, on a scratch state (the fastest counts)."""
INDEPENDENCE_SPREAD = 1.5
"""Replay counts as independent of batch and length when its max/min over the grid is below this
while the trainer step's spread is above it."""


def _replay_next(state, pending, config, threads):
    record = next(pending)
    replay(state, [record], config, threads=threads, start_step=record.step)


def replay_grid(params: list[int], threads: list[int], dtypes: list[str], repeats: int = 3, say=print) -> list[dict]:
    """One row per (params, dtype, threads): fused replay of one record vs the 1R+1W bandwidth limit."""
    config = ZOConfig(lr=1e-6, eps=1e-3, weight_decay=0.01)
    rows = []
    for n in params:
        for dtype in dtypes:
            state = make_state(n, DTYPES[dtype], "zo-sgd")
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            records = make_records(state, config, 1 + len(threads) * repeats)
            replay(state, records[:1], config, threads=threads[0], start_step=0)  # compiles or loads the kernel
            pending = iter(records[1:])
            for p in threads:
                say(f"  replay {n:,} params {dtype} {p} thread{'s' if p > 1 else ''} ...")
                seconds = best_seconds(lambda: _replay_next(state, pending, config, p), repeats)
                limit = bandwidth_limit_seconds(nbytes, p)
                rows.append({"params": n, "dtype": dtype, "threads": p, "state_bytes": nbytes,
                             "replay_seconds": seconds, "bandwidth_limit_seconds": limit,
                             "over_bandwidth_limit": seconds / limit,
                             "params_per_second": n / seconds})
            del state
    for dtype in dtypes:
        for p in threads:
            line = [r for r in rows if r["dtype"] == dtype and r["threads"] == p]
            if len(line) >= 2:
                slope, intercept = np.polyfit([r["params"] for r in line], [r["replay_seconds"] for r in line], 1)
            else:
                slope, intercept = line[0]["replay_seconds"] / line[0]["params"], 0.0
            for r in line:
                r["fit_seconds_per_param"] = float(slope)
                r["fit_intercept_seconds"] = float(intercept)
                r["fit_residual"] = r["replay_seconds"] / (slope * r["params"] + intercept) - 1
    return rows


def _opt(hidden: int, layers: int, max_len: int):
    from zocheck_ray.workload.models import build_model

    overrides = dict(hidden_size=hidden, num_hidden_layers=layers, ffn_dim=4 * hidden, word_embed_proj_dim=hidden,
                     vocab_size=2048, num_attention_heads=max(1, hidden // 64), max_position_embeddings=max_len)
    return build_model("tiny-opt", "fp32", seed=0, overrides=overrides)


def batch_grid(batches: list[int], seq_lens: list[int], hidden: int = 128, layers: int = 2, steps: int = 3,
               threads: int | None = None, say=print) -> list[dict]:
    """One row per (batch, seq_len): the trainer's ZO step and the replay of its records, fastest."""
    from zocheck_ray.workload.data import batch_indices, corpus_tensor, step_seed
    from zocheck_ray.workload.models import trainable_parameters

    model = _opt(hidden, layers, max(seq_lens))
    config = ZOConfig(lr=1e-5, eps=1e-3)
    opt = ZOOptimizer(trainable_parameters(model), config)
    replica = {k: v.detach().clone() for k, v in opt.state_tensors().items()}
    scratch = {k: v.clone() for k, v in replica.items()}
    params = sum(t.numel() for t in replica.values())
    rows = []
    with torch.no_grad():
        for seq_len in seq_lens:
            data = corpus_tensor(seq_len, model.config.vocab_size)
            for batch in batches:
                say(f"  trainer step and replay at batch {batch} x {seq_len} tokens ...")
                step_s, replay_s = [], []
                for i in range(steps + 1):
                    t = opt.step_index
                    ids = data[batch_indices(0, t, batch, data.shape[0])]
                    start = time.perf_counter()
                    record = opt.step(lambda: model(input_ids=ids, labels=ids).loss, seed=step_seed(0, t))
                    step_s.append(time.perf_counter() - start)
                    replay(replica, [record], config, threads=threads, start_step=t)  # the replica follows
                    # the same record again on a scratch state, timed several times (replay is cheap)
                    replay_s.append(best_seconds(lambda: replay(scratch, [record], config, threads=threads, start_step=t),
                                                  REPLAY_REPEATS))
                rows.append({"batch_size": batch, "seq_len": seq_len, "tokens": batch * seq_len, "params": params,
                             "trainer_step_seconds": min(step_s[1:]), "replay_seconds": min(replay_s[1:])})
    # The replica followed the trainer record by record: the bits must agree (replay is exact).
    live = opt.state_tensors()
    rows_equal = all(torch.equal(live[k], replica[k]) for k in live)
    for r in rows:
        r["replica_equals_trainer"] = rows_equal
    return rows


def scaling_benchmark(params: list[int], threads: list[int], dtypes: list[str], batches: list[int],
                      seq_lens: list[int], repeats: int = 3, hidden: int = 128, layers: int = 2,
                      json_path: str | None = None, say=print) -> dict:
    """Both parts, printed; returns the JSON document.

    Keys: benchmark, machine, grid {params, threads, dtypes}, replay (rows of `replay_grid`),
    batch {batches, seq_lens, rows, trainer_spread, replay_spread, independent, replica_equals_trainer},
    threads_speedup {dtype -> {params -> t(1 thread) / t(max threads)}}.
    """
    info = machine()
    info["load_average_before"] = list(os.getloadavg())
    say(f"scaling benchmark: {info['cpu']}, {info['cpu_count']} cores, numba threads {numba.config.NUMBA_NUM_THREADS}")
    grid = replay_grid(params, threads, dtypes, repeats, say)
    batch_rows = batch_grid(batches, seq_lens, hidden, layers, repeats, max(threads), say)

    say("")
    print_table([{**r, "ms": r["replay_seconds"] * 1e3, "limit_ms": r["bandwidth_limit_seconds"] * 1e3,
                  "mps": r["params_per_second"] / 1e6, "fit": r["fit_residual"]} for r in grid], [
        ("params", "params", ","), ("dtype", "dtype", ""), ("threads", "threads", "d"), ("ms", "replay ms", ".2f"),
        ("limit_ms", "1R+1W ms", ".2f"), ("over_bandwidth_limit", "x limit", ".1f"), ("mps", "M params/s", ".0f"),
        ("fit", "off the line", "+.0%")])
    speedup = {}
    for dtype in dtypes:
        for n in params:
            by = {r["threads"]: r["replay_seconds"] for r in grid if r["dtype"] == dtype and r["params"] == n}
            if len(by) > 1:
                speedup.setdefault(dtype, {})[str(n)] = by[min(by)] / by[max(by)]
    trainer = [r["trainer_step_seconds"] for r in batch_rows]
    replays = [r["replay_seconds"] for r in batch_rows]
    trainer_spread, replay_spread = max(trainer) / min(trainer), max(replays) / min(replays)
    independent = replay_spread < INDEPENDENCE_SPREAD < trainer_spread
    # Log-log slopes against tokens per batch: ~1 for work that scales with the batch, ~0 for none.
    tokens = np.log([r["tokens"] for r in batch_rows])
    trainer_slope = float(np.polyfit(tokens, np.log(trainer), 1)[0]) if len(set(tokens)) > 1 else None
    replay_slope = float(np.polyfit(tokens, np.log(replays), 1)[0]) if len(set(tokens)) > 1 else None
    say("")
    print_table([{**r, "step_ms": r["trainer_step_seconds"] * 1e3, "replay_ms": r["replay_seconds"] * 1e3,
                  "ratio": r["trainer_step_seconds"] / r["replay_seconds"]} for r in batch_rows], [
        ("batch_size", "batch", "d"), ("seq_len", "seq len", "d"), ("tokens", "tokens", "d"),
        ("step_ms", "trainer step ms", ".1f"), ("replay_ms", "replay ms", ".2f"), ("ratio", "step/replay", ".0f")])
    say(f"\ntrainer step max/min over the grid: {trainer_spread:.1f}x; replay max/min: {replay_spread:.2f}x -> replay "
        f"{'is' if independent else 'is NOT shown to be'} independent of batch size and sequence length "
        f"(replay spread < {INDEPENDENCE_SPREAD:g} < trainer spread); replica == trainer bits: "
        f"{batch_rows[0]['replica_equals_trainer']}")
    if trainer_slope is not None:
        say(f"log-log slope against tokens per batch: trainer step {trainer_slope:.2f}, replay {replay_slope:.2f}")
    for dtype, by in speedup.items():
        say(f"{dtype}: {min(threads)} -> {max(threads)} threads speeds replay up "
            + ", ".join(f"{v:.2f}x at {int(n):,}" for n, v in by.items()))
    info["load_average_after"] = list(os.getloadavg())
    doc = {"benchmark": "scaling", "machine": info,
           "grid": {"params": params, "threads": threads, "dtypes": dtypes}, "replay": grid,
           "threads_speedup": speedup,
           "batch": {"batches": batches, "seq_lens": seq_lens, "rows": batch_rows, "trainer_spread": trainer_spread,
                     "replay_spread": replay_spread, "independent": independent,
                     "trainer_tokens_slope": trainer_slope, "replay_tokens_slope": replay_slope,
                     "replica_equals_trainer": batch_rows[0]["replica_equals_trainer"]}}
    write_json(json_path, doc)
    return doc


def run(args: argparse.Namespace) -> int:
    limit = numba.config.NUMBA_NUM_THREADS
    threads = args.threads or sorted({1, limit})
    if any(not 1 <= p <= limit for p in threads):
        raise SystemExit(f"--threads must be in [1, {limit}] (NUMBA_NUM_THREADS), got {threads}")
    if any(b < 1 for b in args.batch) or any(s < 2 for s in args.seq_len) or args.repeats < 1:
        raise SystemExit("--batch >= 1, --seq-len >= 2 and --repeats >= 1 are required")
    doc = scaling_benchmark(args.params, threads, args.dtype, args.batch, args.seq_len, args.repeats,
                            args.hidden, args.layers, args.json)
    return 0 if doc["batch"]["independent"] and doc["batch"]["replica_equals_trainer"] else 1


# ------------------------------------------------------------ in `bench all`: options, tables, figures, verdicts

SUITE_OPTIONS = {
    "quick": {"params": [1_000_000, 4_000_000, 16_000_000], "dtypes": ["fp32", "bf16"], "batches": [1, 8],
              "seq_lens": [16, 128], "repeats": 2},
    "full": {"params": [1_000_000, 4_000_000, 16_000_000, 64_000_000], "dtypes": ["fp32", "bf16", "fp16"],
             "batches": [1, 4, 16], "seq_lens": [16, 64, 256], "repeats": 3},
}
"""`scaling_benchmark` options of `bench all`'s run (`--quick` or not), on 1 thread and all of them."""


def run_in_suite(out: Path, quick: bool) -> dict:
    """`bench all`'s run; the JSON in `out`."""
    options = SUITE_OPTIONS["quick" if quick else "full"]
    threads = sorted({1, numba.config.NUMBA_NUM_THREADS})
    return scaling_benchmark(options["params"], threads, options["dtypes"], options["batches"],
                             options["seq_lens"], options["repeats"], json_path=str(out / "scaling.json"))


def markdown(doc: dict) -> str:
    grid = [{**r, "ms": r["replay_seconds"] * 1e3, "limit_ms": r["bandwidth_limit_seconds"] * 1e3,
             "mps": r["params_per_second"] / 1e6} for r in doc["replay"]]
    b = doc["batch"]
    batch = [{**r, "step_ms": r["trainer_step_seconds"] * 1e3, "replay_ms": r["replay_seconds"] * 1e3} for r in b["rows"]]
    return "\n".join([
        "# Replay scaling\n", "Fused replay of one record against the 1 read + 1 write bandwidth limit:\n",
        md_table(grid, [("params", "params", ","), ("dtype", "dtype", ""), ("threads", "threads", "d"),
                        ("ms", "replay ms", ".2f"), ("limit_ms", "1R+1W ms", ".2f"),
                        ("over_bandwidth_limit", "x limit", ".1f"), ("mps", "M params/s", ".0f"),
                        ("fit_residual", "off the fitted line", "+.0%")]),
        "\nTrainer step (two forward passes) against replay of its record, per batch and sequence length:\n",
        md_table(batch, [("batch_size", "batch", "d"), ("seq_len", "seq len", "d"), ("tokens", "tokens", "d"),
                         ("step_ms", "trainer step ms", ".1f"), ("replay_ms", "replay ms", ".2f")]),
        f"\nTrainer step max/min {b['trainer_spread']:.1f}x, replay max/min {b['replay_spread']:.2f}x"
        + (f" (log-log slope against tokens: trainer {b['trainer_tokens_slope']:.2f}, replay "
           f"{b['replay_tokens_slope']:.2f})" if b.get("trainer_tokens_slope") is not None else "")
        + ": replay "
        f"{'is' if b['independent'] else 'is not shown to be'} independent of batch size and sequence length; "
        f"the replica followed the trainer bit for bit: {b['replica_equals_trainer']}.\n"])


def plot_scaling(doc: dict, path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4.2))
    for dtype in doc["grid"]["dtypes"]:
        for p in doc["grid"]["threads"]:
            line = [r for r in doc["replay"] if r["dtype"] == dtype and r["threads"] == p]
            left.plot([r["params"] for r in line], [r["replay_seconds"] * 1e3 for r in line], marker="o",
                      label=f"{dtype}, {p} thread{'s' if p > 1 else ''}")
    limit = [r for r in doc["replay"] if r["dtype"] == doc["grid"]["dtypes"][0]
             and r["threads"] == max(doc["grid"]["threads"])]
    left.plot([r["params"] for r in limit], [r["bandwidth_limit_seconds"] * 1e3 for r in limit], "k--",
              label=f"1R+1W limit ({doc['grid']['dtypes'][0]})")
    left.set(xscale="log", yscale="log", xlabel="parameters", ylabel="replay of one record (ms)")
    left.legend(fontsize=7)
    left.grid(True, which="both", alpha=0.3)
    rows = sorted(doc["batch"]["rows"], key=lambda r: r["tokens"])
    right.plot([r["tokens"] for r in rows], [r["trainer_step_seconds"] * 1e3 for r in rows], "o-",
               label="trainer ZO step (2 forward passes)")
    right.plot([r["tokens"] for r in rows], [r["replay_seconds"] * 1e3 for r in rows], "s-", label="replay of its record")
    right.set(xscale="log", yscale="log", xlabel="tokens per batch (batch x sequence length)", ylabel="ms")
    right.legend(fontsize=7)
    right.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FIGURES = [("scaling.png", plot_scaling)]
"""(file name, plot(doc, path)) of each figure `bench all` draws from this benchmark's document."""


def verdicts(doc: dict) -> list[str]:
    """The summary's lines for this benchmark's targets."""
    b = doc["batch"]
    return [f"replay independent of batch size and sequence length: {b['independent']} (trainer step "
            f"{b['trainer_spread']:.1f}x over the grid, replay {b['replay_spread']:.2f}x)"]


def register(bench) -> None:
    from benchmarks.overhead import parse_count

    parser = bench.add_parser("scaling", help="replay time vs parameters, threads, dtype; independent of batch/length",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", nargs="+", type=parse_count, default=[parse_count(p) for p in DEFAULT_PARAMS],
                        metavar="N", help="parameter counts (default 1M 4M 16M 64M)")
    parser.add_argument("--threads", nargs="+", type=int, metavar="P", help="replay threads (default: 1 and all)")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16", "fp16"])
    parser.add_argument("--batch", nargs="+", type=int, default=DEFAULT_BATCHES, help="batch sizes (default 1 4 16)")
    parser.add_argument("--seq-len", nargs="+", type=int, default=DEFAULT_SEQ_LENS,
                        help="sequence lengths (default 16 64 256)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the part-2 OPT (default 128)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the part-2 OPT (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per point (default 3)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.set_defaults(func=run)
