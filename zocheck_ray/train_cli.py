"""`zocheck-ray train` and `zocheck-ray status`.

    zocheck-ray train [--config FILE] [--set key=value ...] [--steps N] [--storage URL]
                      [--fail-at 20,35,50|none] [--fail-mode software] [--json FILE]
    zocheck-ray status RUN_ID [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from zocheck_ray.config import JobConfigError, load_job_config


def _fail_at(text: str) -> list[int]:
    if text in ("", "none"):
        return []
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fail-at takes comma-separated steps or 'none', got {text!r}") from None


def train(args: argparse.Namespace) -> int:
    import ray

    from zocheck_ray.controller import run

    try:
        job = load_job_config(args.config, args.set, steps=args.steps, storage=args.storage)
        if args.address:
            ray.init(address=args.address, namespace="zocheck", log_to_driver=False)
        summary = run(job, fail_at=args.fail_at, fail_mode=args.fail_mode)
    except JobConfigError as exc:
        print(f"zocheck-ray train: {exc}", file=sys.stderr)
        return 2
    m = summary.metrics
    print()
    rows = [
        ("run", summary.run_id), ("steps", summary.steps),
        ("loss (first -> last)", f"{summary.losses[0][1]:.4f} -> {summary.losses[-1][1]:.4f}" if summary.losses else "-"),
        ("publish per step", f"{summary.publish_us_median:.1f} us (median)" if summary.publish_us_median else "-"),
        ("trainer step", f"{summary.trainer_seconds_per_step * 1e3:.1f} ms"),
        ("replay step", f"{m['replay_seconds_per_step'] * 1e3:.2f} ms"),
        ("snapshot interval", summary.snapshot_interval),
        ("snapshots taken / persisted", f"{m['snapshots_taken']} / {m['snapshots_persisted']}"),
        ("resyncs", m["resync_count"]),
        ("recoveries", "; ".join(f"step {r.failed_at_step} -> {r.recovered_step} from {r.image_source} in "
                                 f"{r.seconds:.2f} s" for r in summary.recoveries) or "none"),
        ("final state_hash", summary.final_state_hash),
        ("shadow == trainer", "yes, bit for bit" if summary.final_state_hash == summary.shadow_state_hash else "NO"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key.ljust(width)}  {value}")
    if args.json:
        with open(args.json, "w") as f:
            f.write(summary.model_dump_json(indent=2))
        print(f"wrote {args.json}")
    return 0 if summary.final_state_hash == summary.shadow_state_hash else 1


def status(args: argparse.Namespace) -> int:
    import ray

    from zocheck_ray.actors.ray_actors import NAMESPACE, shadow_name

    if not ray.is_initialized():
        ray.init(address=args.address or "auto", namespace=NAMESPACE, log_to_driver=False)
    try:
        shadow = ray.get_actor(shadow_name(args.run_id), namespace=NAMESPACE)
    except ValueError:
        print(f"zocheck-ray status: no running shadow for run {args.run_id!r}", file=sys.stderr)
        return 2
    metrics = ray.get(shadow.metrics.remote())
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        for key, value in metrics.items():
            print(f"{key:28s} {value}")
    return 0


def register(commands, bench) -> None:
    p = commands.add_parser("train", help="run a ZO fine-tuning job with a shadow on Ray",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="job YAML (see JobConfig)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--steps", type=int)
    p.add_argument("--storage", help="durable storage root URL (path, file://, s3://)")
    p.add_argument("--fail-at", type=_fail_at, default=[], help="kill the trainer at these steps")
    p.add_argument("--fail-mode", choices=["software", "host"], default="software",
                   help="software: kill the trainer process; host: lose both processes and their in-memory "
                        "images, so the pair comes back from durable storage")
    p.add_argument("--address", help="Ray cluster address (default: start a local one)")
    p.add_argument("--json", metavar="FILE", help="write the run summary as JSON")
    p.set_defaults(func=train)
    s = commands.add_parser("status", help="metrics of a running job's shadow")
    s.add_argument("run_id")
    s.add_argument("--address", help="Ray cluster address (default: auto)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=status)
