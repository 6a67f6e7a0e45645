"""`python -m benchmarks adapters`: the shadow's memory and a snapshot's size with a peft adapter.

    python -m benchmarks adapters --json benchmarks/results/adapters.json
    python -m benchmarks adapters --size 14M --json /tmp/adapters.json

An OPT of `--size` (built from its config and saved with `save_pretrained`, as `bench scale` builds
them: nothing is downloaded) is fine-tuned for a few steps with full-parameter ZO, a LoRA adapter
(`--rank`, on q_proj and v_proj) and prefix tuning (`--virtual-tokens`), in this process: the run's
`Trainer` and `Shadow` joined without Ray (`testing.in_process`), then drained, so the newest snapshot
is durable. Per run:

- `state_bytes`: the trainable state (with peft, the adapter alone: the frozen base is not in it);
- the shadow's peak of state-sized memory by its own accounting (`peak_held_bytes`: the replica plus
  its one image) and that over the state's bytes (the budget of the scale work: 2x for ZO-SGD);
- the durable snapshot's bytes on storage (every file of its directory: weights, config, manifest)
  and that over the state's bytes;
- the peak a run with the startup profile adds to it while the profile lasts: the profile times
  replays on a scratch copy of the state's leading tensors (`runtime.replay.ProfileScratch`: 1/32 of
  the state, within [64 KiB, 64 MiB]); the runs here set `shadow.snapshot_interval`,
  so they take no profile;
- the base model's bytes, for scale.

Targets, with an adapter: the shadow's peak within 10% of 2x the adapter's bytes, the snapshot within
10% of the adapter's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from benchmarks.common import machine, report_exact_targets

METHODS = ("full", "lora", "prefix")
BUDGET = 2
"""The shadow's state-sized memory, in states: its replica and one image (ZO-SGD)."""
TOLERANCE = 0.10


def _job(model_dir: str, storage: str, data: str, method: str, args):
    from zocheck_ray.config import JobConfig

    peft = {"full": None, "lora": {"method": "lora", "r": args.rank, "target_modules": ["q_proj", "v_proj"]},
            "prefix": {"method": "prefix", "num_virtual_tokens": args.virtual_tokens}}[method]
    return JobConfig.model_validate(dict(
        model=model_dir, dtype=args.dtype, steps=args.steps, storage=storage,
        shadow=dict(snapshot_interval=2, max_lag_steps=10**6), durability=dict(durable_interval=2),
        log_interval=2, peft=peft, zo=dict(optimizer="zo-sgd", lr=1e-4, eps=1e-3),
        task=dict(kind="lm", data_path=data, text_field="text", batch_size=1, max_length=16, eval_size=1,
                  eval_interval=10**9)))


def _snapshot_bytes(run_dir: str, step: int) -> int:
    from zocheck_ray.storage import snapshot_dir

    root = os.path.join(run_dir, snapshot_dir(step))
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def _profile_scratch_bytes(job) -> int:
    """The bytes of the scratch the startup profile would copy of this job's state."""
    from zocheck_ray.runtime.replay import ProfileScratch
    from zocheck_ray.core import ZOOptimizer
    from zocheck_ray.workload.adapters import build_trainable

    built = build_trainable(job.model, job.dtype, job.run_seed, job.peft)
    return ProfileScratch(ZOOptimizer(built.parameters, job.zo).state_tensors(), job.zo).bytes


def measure(model_dir: str, base_bytes: int, method: str, args, root: str, data: str) -> dict:
    """One run of `method`; its row of the table."""
    from zocheck_ray.testing.in_process import run_in_process

    job = _job(model_dir, os.path.join(root, method), data, method, args)
    run = run_in_process(job)
    m = run.metrics
    snapshot = _snapshot_bytes(job.run_url, m.durable_step)
    profile_peak = m.peak_held_bytes + _profile_scratch_bytes(job)
    row = {"method": method, "base_bytes": base_bytes, "state_bytes": m.state_bytes,
           "profile_peak_bytes": profile_peak, "profile_peak_over_state": profile_peak / m.state_bytes,
           "peak_held_bytes": m.peak_held_bytes, "peak_over_state": m.peak_held_bytes / m.state_bytes,
           "snapshot_bytes": snapshot, "snapshot_over_state": snapshot / m.state_bytes,
           "state_over_base": m.state_bytes / base_bytes, "exact": run.shadow == (job.steps, run.final_hash)}
    if method != "full":
        row["memory_met"] = abs(m.peak_held_bytes / (BUDGET * m.state_bytes) - 1) <= TOLERANCE
        row["snapshot_met"] = abs(snapshot / m.state_bytes - 1) <= TOLERANCE
    return row


def run(args) -> dict:
    import torch

    from benchmarks.scale import SIZES, build_directory

    if args.size not in SIZES:
        raise SystemExit(f"--size must be one of {sorted(SIZES)}, got {args.size!r}")
    torch.set_num_threads(args.torch_threads)
    with tempfile.TemporaryDirectory(prefix="zocheck-adapters-") as root:
        model_dir, params = build_directory(args.size, root)
        data = os.path.join(root, "rows.jsonl")
        with open(data, "w") as f:
            f.write("".join(json.dumps({"text": f"row {i} of a small corpus"}) + "\n" for i in range(16)))
        base_bytes = params * {"fp32": 4, "bf16": 2, "fp16": 2}[args.dtype]
        rows = [measure(model_dir, base_bytes, method, args, root, data) for method in args.methods]
    for row in rows:
        row.update(size=args.size, dtype=args.dtype, params=params)
    targets = [{"target": f"{r['method']}: shadow peak within {TOLERANCE:.0%} of {BUDGET}x the adapter's bytes, "
                          f"snapshot within {TOLERANCE:.0%} of them",
                "measured": f"{r['peak_over_state']:.3f}x and {r['snapshot_over_state']:.3f}x the adapter's bytes",
                "met": bool(r["memory_met"] and r["snapshot_met"])} for r in rows if r["method"] != "full"]
    return {"benchmark": "adapters", "machine": machine(), "results": rows, "targets": targets}


COLUMNS = [("method", "method", "s"), ("state_bytes", "state B", ",d"), ("peak_held_bytes", "shadow peak B", ",d"),
           ("peak_over_state", "peak/state", ".3f"), ("snapshot_bytes", "snapshot B", ",d"),
           ("snapshot_over_state", "snapshot/state", ".3f"), ("profile_peak_over_state", "in profile", ".3f"),
           ("state_over_base", "state/base", ".5f"),
           ("exact", "exact", "")]


def run_cli(args) -> int:
    doc = run(args)
    print(f"OPT {args.size} ({doc['results'][0]['params']:,} parameters, {args.dtype}), ZO-SGD, {args.steps} steps")
    return report_exact_targets(doc, COLUMNS, args.json)


def register(bench) -> None:
    b = bench.add_parser("adapters", help="the shadow's memory and a snapshot's size with LoRA and prefix adapters")
    add_arguments(b)
    b.set_defaults(func=run_cli)


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--size", default="125M", help="OPT size, as `bench scale` names them (default 125M)")
    b.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    b.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    b.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    b.add_argument("--virtual-tokens", type=int, default=16, help="prefix tuning's virtual tokens (default 16)")
    b.add_argument("--steps", type=int, default=6)
    b.add_argument("--torch-threads", type=int, default=1, help="the trainer's intra-op threads (default 1)")
    b.add_argument("--json", metavar="FILE", help="also write the results as JSON")
