"""The `zocheck-ray` command line.

    zocheck-ray train                     the embedded default job: local Ray, one injected
                                          failure, exact recovery, verified against the durable log
    zocheck-ray train --config job.yaml   a job from YAML (`--set key=value` overrides)
    zocheck-ray status RUN_ID             a running job's shadow metrics
    zocheck-ray bench all --out DIR       every benchmark as JSON, Markdown and figures

Each feature module registers its own subcommands (`register(subparsers, bench)`),
so this file only lists them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = [
    "zocheck_ray.bench.replay", "zocheck_ray.bench.trainer",
    "zocheck_ray.bench.overhead", "zocheck_ray.bench.recovery",
    "zocheck_ray.bench.waste", "zocheck_ray.bench.scaling", "zocheck_ray.bench.memory", "zocheck_ray.bench.report",
    "zocheck_ray.bench.data_parallel",
    "zocheck_ray.policies.cli",
    "zocheck_ray.storage.cli",
    "zocheck_ray.train_cli",
    "zocheck_ray.tune",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zocheck-ray",
        description="Nearly free, bit-exact checkpointing for zeroth-order fine-tuning on Ray.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench_parser = sub.add_parser("bench", help="benchmarks: print a table, optionally write JSON")
    bench = bench_parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub, bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
