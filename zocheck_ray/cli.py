"""The `zocheck-ray` command line.

    zocheck-ray train                     the embedded default job: local Ray, one injected
                                          failure, exact recovery, verified against the durable log
    zocheck-ray train --config job.yaml   a job from YAML (`--set key=value` overrides)
    zocheck-ray status RUN_ID             a running job's shadow metrics
    zocheck-ray bench all --out DIR       every benchmark as JSON, Markdown and figures (from a checkout)

Each feature module registers its own subcommands (`register(subparsers)`); `bench` hands its
arguments to the repository's `python -m benchmarks`, which is not installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

COMMAND_MODULES = [
    "zocheck_ray.policies.cli",
    "zocheck_ray.storage.cli",
    "zocheck_ray.train_cli",
    "zocheck_ray.tune",
]

CHECKOUT = Path(__file__).resolve().parent.parent
"""The repository this package runs from, when it runs from a checkout (an editable install)."""


def run_benchmarks(argv: list[str]) -> int:
    """`zocheck-ray bench ARGV`: `python -m benchmarks ARGV` of the checkout the package runs from."""
    if not (CHECKOUT / "benchmarks" / "cli.py").is_file():
        print("zocheck-ray bench: the benchmarks are not installed with the package; they are a program of the "
              "repository's benchmarks/ directory. In a checkout: pip install -e '.[bench]', then "
              "python -m benchmarks --help (or zocheck-ray bench --help)", file=sys.stderr)
        return 2
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    return importlib.import_module("benchmarks.cli").main(argv, prog="zocheck-ray bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zocheck-ray",
        description="Nearly free, bit-exact checkpointing for zeroth-order fine-tuning on Ray.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = sub.add_parser("bench", add_help=False,
                           help="benchmarks (from a checkout): print a table, optionally write JSON; "
                                "`zocheck-ray bench --help` lists them")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=lambda args: run_benchmarks(args.bench_args))
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every later argument is the benchmarks' own, --help included
        return run_benchmarks(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
