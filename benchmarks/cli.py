"""The benchmarks' command line: `python -m benchmarks NAME ...` (or `zocheck-ray bench NAME ...` from a checkout).

    python -m benchmarks --help
    python -m benchmarks all --out benchmarks/results --quick
    python -m benchmarks replay --params 5M --json /tmp/replay.json

Each benchmark module registers its own subcommand (`register(subparsers)`), so this file
only lists them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHMARK_MODULES = [
    "benchmarks.replay", "benchmarks.trainer", "benchmarks.overhead", "benchmarks.recovery", "benchmarks.waste",
    "benchmarks.scaling", "benchmarks.memory", "benchmarks.suite", "benchmarks.data_parallel", "benchmarks.storage",
    "benchmarks.scale", "benchmarks.adapters", "benchmarks.detection", "benchmarks.host_paths", "benchmarks.elastic",
    "benchmarks.zotrainer", "benchmarks.quantized",
]


def build_parser(prog: str = "python -m benchmarks") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="zocheck-ray's benchmarks: each prints a table and writes JSON, against a baseline "
                               "measured in the same run.")
    bench = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name in BENCHMARK_MODULES:
        importlib.import_module(name).register(bench)
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
