"""`python -m benchmarks memory`: peak host (and GPU) memory per strategy, and the shadow's against model size.

    python -m benchmarks memory --json benchmarks/results/memory.json
    python -m benchmarks memory --sizes 10M 50M --hidden 256 --layers 2 --json memory-small.json

Every configuration runs in a fresh Python process, which reports its own peak resident
set (`VmHWM` in /proc/self/status; `ru_maxrss` where that is missing) and, where CUDA is
present, `torch.cuda.max_memory_allocated`. Peaks are compared with a baseline process
measured in the same run, so the interpreter, torch and the model cancel out:

- per strategy, the same ZO loop on an OPT built from a config (real forward passes,
  same data and seeds), with only the checkpointing changed: `trainer` alone (log-only:
  each record is a few tens of bytes), `zocheck` (a `Shadow` in the same process, fed
  every record: host replica, snapshot images, persistence to a local directory),
  `async-checkpoint` (the baseline's staging copy, `benchmarks.baselines.stage`, and a
  background `SnapshotStore.save`, one in flight) and `sync-checkpoint`
  (`SnapshotStore.save` every K steps). The extra memory over `trainer` is the strategy's;
- the shadow alone against model size: a process holds a state of P parameters and its
  records (and has loaded the replay kernel), resets and takes its peak, then starts a `Shadow`
  initialised from that state and fed the records (it replays, snapshots and holds its
  newest image); the rise of the peak, against the state's bytes.

On a GPU the replica and the snapshots stay on the host while the trainer's state is on
the device, so the host columns are what ZOCheck adds to the machine's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import STYLE, machine, md_table, print_table, pyplot, save_opt, write_json

DEFAULT_SIZES = ["25M", "50M", "100M", "200M"]
STRATEGIES = ("trainer", "zocheck", "async-checkpoint", "sync-checkpoint")
CHECKPOINT_EVERY = 7


def peak_host_bytes() -> int:
    """This process's peak resident set, in bytes."""
    from zocheck_ray.host.memory import process_memory

    return process_memory().get("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _gpu_peak() -> int | None:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


# ----------------------------------------------------------------------------- children


def _warm_kernel() -> None:
    """Load the replay kernel in every child: its code is the same for all, not a strategy's state."""
    import torch

    from benchmarks.replay import make_records, make_state
    from zocheck_ray.core import ZOConfig, replay

    zo = ZOConfig(lr=1e-6, eps=1e-3)
    warm = make_state(4096 + 7, torch.float32, "zo-sgd")
    replay(warm, make_records(warm, zo, 1), zo, threads=1, start_step=0)


def _strategy_child(spec: dict) -> dict:
    """One strategy around the same ZO loop (model, data, seeds), so only the checkpointing differs."""
    import threading
    from collections import deque

    import torch

    from zocheck_ray.runtime.shadow import Shadow
    from benchmarks.baselines import stage
    from zocheck_ray.config import JobConfig
    from zocheck_ray.core import ZOOptimizer
    from zocheck_ray.storage import SnapshotStore
    from zocheck_ray.workload.data import batch_indices, corpus_tensor, step_seed
    from zocheck_ray.workload.models import build_model, trainable_parameters

    _warm_kernel()
    strategy, steps, storage, every = spec["strategy"], spec["steps"], spec["storage"], spec["every"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    job = JobConfig(model=spec["model"], steps=steps, storage=storage,
                    shadow={"snapshot_interval": spec["snapshot_interval"]}, run_id=f"memory-{strategy}")
    started = time.perf_counter()
    model = build_model(job.model, "fp32", seed=0).to(device)
    opt = ZOOptimizer(trainable_parameters(model), job.zo)
    data = corpus_tensor(spec["seq_len"], model.config.vocab_size).to(device)
    state = opt.state_tensors()
    log: deque = deque()
    shadow = store = writer = None
    extra = {}
    if strategy == "zocheck":
        shadow = Shadow(job)
        shadow.initialize(0, {k: v.detach().to("cpu").clone() for k, v in state.items()})
    elif strategy in ("async-checkpoint", "sync-checkpoint"):
        store = SnapshotStore(os.path.join(storage, strategy))
    checkpoints = 0
    with torch.no_grad():
        for t in range(steps):
            ids = data[batch_indices(0, t, spec["batch_size"], data.shape[0])]
            record = opt.step(lambda: model(input_ids=ids, labels=ids).loss, seed=step_seed(0, t))
            log.append(record)  # log-only: the record leaves the process; a few tens of bytes
            if shadow is not None:
                shadow.push(record.to_bytes())
            elif store is not None and opt.step_index % every == 0:
                if strategy == "sync-checkpoint":
                    store.save(opt.step_index, state, {"run_id": job.run_id})
                else:  # staging copy on the critical path, the write in the background, one in flight
                    if writer is not None:
                        writer.join()
                    staged = stage(state)
                    writer = threading.Thread(target=store.save, args=(opt.step_index, staged, {"run_id": job.run_id}))
                    writer.start()
                    del staged
                checkpoints += 1
    if writer is not None:
        writer.join()
    if shadow is not None:
        if not shadow.replay.wait_replayed(steps, timeout=300):
            raise RuntimeError(f"the shadow replayed {shadow.replay.replayed_step} of {steps} records in 300 s")
        extra.update(snapshots=shadow.replay.snapshots_taken, replayed_step=shadow.replay.replayed_step)
        shadow.close()
    if store is not None:
        extra["checkpoints"] = checkpoints
    return {"strategy": strategy, "peak_host_bytes": peak_host_bytes(), "peak_gpu_bytes": _gpu_peak(),
            "state_bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "params": sum(t.numel() for t in state.values()), "device": device,
            "seconds": time.perf_counter() - started, **extra}


def reset_peak() -> bool:
    """Reset this process's peak resident set to its current one (Linux: /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def _shadow_child(spec: dict) -> list[dict]:
    """For each size: the peak before and after a `Shadow` joins a process that already holds the
    state and its records. Between sizes the peak is reset, so one process measures them all."""
    import gc

    import torch

    from zocheck_ray.runtime.shadow import Shadow
    from benchmarks.replay import make_records, make_state
    from zocheck_ray.config import JobConfig
    from zocheck_ray.core import ZOConfig

    zo = ZOConfig(lr=1e-6, eps=1e-3)
    _warm_kernel()
    rows = []
    for n in spec["sizes"]:
        gc.collect()
        state = make_state(n, torch.float32, "zo-sgd")
        records = make_records(state, zo, spec["records"])
        if len(spec["sizes"]) > 1 and not reset_peak():
            raise RuntimeError("the peak resident set cannot be reset here: measure one size per process")
        before = peak_host_bytes()
        job = JobConfig(model="tiny-opt", zo=zo, shadow={"snapshot_interval": spec["snapshot_interval"]},
                        storage=spec["storage"], run_id="memory-shadow")
        shadow = Shadow(job, threads=1, persist=False)
        shadow.initialize(0, state)
        shadow.push(b"".join(r.to_bytes() for r in records))
        if not shadow.replay.wait_replayed(len(records), timeout=300):
            raise RuntimeError(f"the shadow replayed {shadow.replay.replayed_step} of {len(records)} records in "
                               "300 s")
        snapshots = shadow.replay.snapshots_taken
        shadow.close()
        rows.append({"params": n, "baseline_peak_host_bytes": before, "peak_host_bytes": peak_host_bytes(),
                     "state_bytes": sum(t.numel() * t.element_size() for t in state.values()),
                     "snapshots": snapshots})
        del shadow, state, records
    return rows


def _run_child(kind: str, spec: dict) -> dict:
    """Run one configuration in a fresh interpreter; its last stdout line is its JSON result."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--child", kind, json.dumps(spec)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"memory child {kind} {spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the benchmark


def memory_benchmark(sizes: list[int], hidden: int = 1024, layers: int = 2, steps: int = 14, snapshot_interval: int = 4,
                     every: int = CHECKPOINT_EVERY, records: int = 8, strategies: tuple[str, ...] = STRATEGIES,
                     json_path: str | None = None, say=print) -> dict:
    """Measure every strategy and every shadow size, print the tables; returns the JSON document.

    Keys: benchmark, machine, strategies (one row per strategy: peak_host_bytes, extra_host_bytes over the
    trainer alone, extra_over_state, peak_gpu_bytes or None), shadow (one row per size: state_bytes,
    peak_host_bytes, baseline_peak_host_bytes, extra_host_bytes, extra_over_state), gpu (bool), invariants.
    """
    if not strategies or strategies[0] != "trainer" or any(s not in STRATEGIES for s in strategies):
        raise ValueError(f"strategies must start with 'trainer', the baseline the others are compared with, and "
                         f"name only {', '.join(STRATEGIES)}; got {strategies!r}")
    info = machine()
    info["load_average_before"] = list(os.getloadavg())
    say(f"memory benchmark: strategies on an OPT (hidden {hidden}, {layers} layers); shadow at "
        f"{', '.join(f'{s:,}' for s in sizes)} parameters; {info['cpu']}")
    work = tempfile.mkdtemp(prefix="zocheck-bench-memory-")
    try:
        model, params = save_opt(os.path.join(work, "model"), hidden, layers)
        names, strategies = strategies, []
        for strategy in names:
            say(f"  {strategy} ({params:,} parameters, {steps} steps) ...")
            spec = dict(strategy=strategy, model=model, steps=steps, storage=os.path.join(work, strategy),
                        snapshot_interval=snapshot_interval, every=every, batch_size=4, seq_len=32)
            strategies.append(_run_child("strategy", spec))
        base = strategies[0]
        for row in strategies:
            row["extra_host_bytes"] = row["peak_host_bytes"] - base["peak_host_bytes"]
            row["extra_over_state"] = row["extra_host_bytes"] / row["state_bytes"]
        say(f"  shadow at {', '.join(f'{n:,}' for n in sizes)} parameters ...")
        spec = dict(records=records, snapshot_interval=snapshot_interval, storage=work)
        if os.path.exists("/proc/self/clear_refs"):  # one process, the peak reset between sizes
            measured = _run_child("shadow", {**spec, "sizes": sizes})
        else:
            measured = [r for n in sizes for r in _run_child("shadow", {**spec, "sizes": [n]})]
        shadow = []
        for r in measured:
            extra = r["peak_host_bytes"] - r["baseline_peak_host_bytes"]
            shadow.append({**r, "extra_host_bytes": extra, "extra_over_state": extra / r["state_bytes"]})
    finally:
        shutil.rmtree(work, ignore_errors=True)

    gpu = any(r["peak_gpu_bytes"] is not None for r in strategies)
    mb = 2**20
    say("")
    rows = [{**r, "peak_mb": r["peak_host_bytes"] / mb, "extra_mb": r["extra_host_bytes"] / mb,
             "state_mb": r["state_bytes"] / mb,
             "gpu_mb": None if r["peak_gpu_bytes"] is None else r["peak_gpu_bytes"] / mb} for r in strategies]
    columns = [("strategy", "strategy", ""), ("state_mb", "state MB", ".1f"), ("peak_mb", "peak host MB", ".0f"),
               ("extra_mb", "over trainer MB", ".0f"), ("extra_over_state", "x state", ".2f")]
    if gpu:
        columns.append(("gpu_mb", "peak GPU MB", ".0f"))
    print_table(rows, columns)
    say("")
    print_table([{**r, "state_mb": r["state_bytes"] / mb, "peak_mb": r["peak_host_bytes"] / mb,
                  "extra_mb": r["extra_host_bytes"] / mb} for r in shadow],
                [("params", "params", ","), ("state_mb", "state MB", ".0f"), ("peak_mb", "peak host MB", ".0f"),
                 ("extra_mb", "shadow MB", ".0f"), ("extra_over_state", "x state", ".2f")])
    by = {r["strategy"]: r for r in strategies}
    invariants = {}
    if "zocheck" in by:
        invariants["zocheck_holds_at_least_one_state_copy"] = by["zocheck"]["extra_host_bytes"] >= by["zocheck"]["state_bytes"]
    invariants.update({
        "shadow_holds_at_least_one_state_copy": all(r["extra_host_bytes"] >= r["state_bytes"] for r in shadow),
        "shadow_grows_with_model_size": all(a["extra_host_bytes"] < b["extra_host_bytes"]
                                            for a, b in zip(shadow, shadow[1:])),
    })
    say("\n" + "; ".join(f"{k.replace('_', ' ')}: {'yes' if v else 'NO'}" for k, v in invariants.items()))
    say("(on a GPU the trainer's state lives on the device: these extras are what each strategy adds to host memory)")
    info["load_average_after"] = list(os.getloadavg())
    doc = {"benchmark": "memory", "machine": info, "model_params": params, "steps": steps,
           "snapshot_interval": snapshot_interval, "checkpoint_every": every, "gpu": gpu,
           "strategies": strategies, "shadow": shadow, "invariants": invariants}
    write_json(json_path, doc)
    return doc


def run(args: argparse.Namespace) -> int:
    if args.hidden < 8 or args.layers < 1 or args.steps < 1 or args.snapshot_interval < 1 or args.records < 1:
        raise SystemExit("--hidden >= 8, --layers, --steps, --snapshot-interval and --records >= 1 are required")
    doc = memory_benchmark(args.sizes, args.hidden, args.layers, args.steps, args.snapshot_interval,
                           args.checkpoint_every, args.records, args.json)
    return 0 if all(doc["invariants"].values()) else 1


# ------------------------------------------------------------ in `bench all`: options, tables, figures, verdicts

SUITE_OPTIONS = {
    "quick": {"sizes": [10_000_000, 40_000_000, 80_000_000], "hidden": 512, "layers": 2, "steps": 14},
    "full": {"sizes": [25_000_000, 50_000_000, 100_000_000, 200_000_000]},
}
"""`memory_benchmark` options of `bench all`'s run (`--quick` or not)."""


def run_in_suite(out: Path, quick: bool) -> dict:
    """`bench all`'s run; the JSON in `out`."""
    return memory_benchmark(json_path=str(out / "memory.json"), **SUITE_OPTIONS["quick" if quick else "full"])


def markdown(doc: dict) -> str:
    mb = 2**20
    strategies = [{**r, "peak": r["peak_host_bytes"] / mb, "extra": r["extra_host_bytes"] / mb,
                   "state": r["state_bytes"] / mb,
                   "gpu": None if r["peak_gpu_bytes"] is None else r["peak_gpu_bytes"] / mb} for r in doc["strategies"]]
    columns = [("strategy", "strategy", ""), ("state", "state MB", ".1f"), ("peak", "peak host MB", ".0f"),
               ("extra", "over trainer MB", ".0f"), ("extra_over_state", "x state", ".2f")]
    if doc["gpu"]:
        columns.append(("gpu", "peak GPU MB", ".0f"))
    shadow = [{**r, "state": r["state_bytes"] / mb, "extra": r["extra_host_bytes"] / mb} for r in doc["shadow"]]
    return "\n".join([
        "# Memory\n", f"Per strategy, an OPT of {doc['model_params']:,} parameters trained {doc['steps']} steps "
        "(peak resident set of a fresh process each; 'over trainer' is the extra over the trainer alone):\n",
        md_table(strategies, columns),
        "" if doc["gpu"] else "\n(no CUDA device: no GPU column)",
        "".join(f"\n{r['strategy']}: its peak is within noise of the trainer's. The peak is taken over the "
                "whole process, building the model included, and checkpointing during training did not raise "
                "it (per-phase peaks are not measured).\n"
                for r in doc["strategies"] if r["strategy"].endswith("checkpoint")
                and r["extra_host_bytes"] < r["state_bytes"]),
        "\nThe shadow's host memory against model size (fp32 state):\n",
        md_table(shadow, [("params", "params", ","), ("state", "state MB", ".0f"), ("extra", "shadow MB", ".0f"),
                          ("extra_over_state", "x state", ".2f")]),
        "\nInvariants: " + ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in doc["invariants"].items()) + "\n"])


def plot_memory(doc: dict, path: Path) -> None:
    plt = pyplot()
    mb = 2**20
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4.2))
    names = [r["strategy"] for r in doc["strategies"]]
    left.bar(names, [r["extra_host_bytes"] / mb for r in doc["strategies"]],
             color=[STYLE.get(n, ("tab:gray", ""))[0] for n in names])
    left.axhline(doc["strategies"][0]["state_bytes"] / mb, color="k", ls="--", lw=1, label="one state copy")
    left.set(ylabel="peak host memory over the trainer alone (MB)")
    left.tick_params(axis="x", labelsize=7)
    left.legend(fontsize=7)
    shadow = doc["shadow"]
    right.plot([r["state_bytes"] / mb for r in shadow], [r["extra_host_bytes"] / mb for r in shadow], "o-",
               color="tab:green", label="shadow (measured peak)")
    right.plot([r["state_bytes"] / mb for r in shadow], [r["state_bytes"] / mb for r in shadow], "k--", lw=1,
               label="one state copy")
    right.set(xlabel="model state (MB)", ylabel="shadow's host memory (MB)")
    right.legend(fontsize=7)
    right.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FIGURES = [("memory.png", plot_memory)]
"""(file name, plot(doc, path)) of each figure `bench all` draws from this benchmark's document."""


def verdicts(doc: dict) -> list[str]:
    """The summary's lines for this benchmark's targets."""
    return [f"{k.replace('_', ' ')}: {v}" for k, v in doc["invariants"].items()]


def register(bench) -> None:
    from benchmarks.overhead import parse_count

    parser = bench.add_parser("memory", help="peak host/GPU memory per strategy; the shadow's against model size",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", type=parse_count, default=[parse_count(s) for s in DEFAULT_SIZES],
                        metavar="N", help="shadow state sizes in parameters, fp32 (default 25M 50M 100M 200M)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size of the strategies' OPT (default 1024)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the strategies' OPT (default 2)")
    parser.add_argument("--steps", type=int, default=14, help="training steps per strategy (default 14)")
    parser.add_argument("--snapshot-interval", type=int, default=4, help="the shadow's N (default 4)")
    parser.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY,
                        help=f"the checkpoint baselines' K (default {CHECKPOINT_EVERY})")
    parser.add_argument("--records", type=int, default=8, help="records replayed by the sized shadows (default 8)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.set_defaults(func=run)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child = {"strategy": _strategy_child, "shadow": _shadow_child}[sys.argv[2]]
        print(json.dumps(child(json.loads(sys.argv[3]))))
    else:
        sys.exit("usage: python -m benchmarks.memory --child {strategy|shadow} SPEC "
                 "(use `python -m benchmarks memory`)")
