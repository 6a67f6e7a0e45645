"""The order `make test` hands the test modules to its processes: the longest first.

`--dist loadfile` gives each test process whole modules, one at a time, in the order collected. A long
module handed out last keeps one process busy while the other has nothing left, so the modules are sorted
by how long each took in a measured run (`module_seconds.json`, beside this file), longest first; a module
it does not list counts as `UNLISTED_SECONDS`. The figures only order the work: a stale or missing entry
makes the suite slower, never different.

Refresh the figures with `make module-seconds` (the whole suite with `--durations=0`, then this file as a
program reading its output).
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

FIGURES = Path(__file__).with_name("module_seconds.json")
UNLISTED_SECONDS = 10.0
"""A module not in the figures (new since they were measured): about the median integration module's."""

_DURATION = re.compile(r"^\s*([0-9.]+)s (?:setup|call|teardown)\s+(\S+?\.py)(?:::|\s|$)")


def load() -> dict[str, float]:
    """The measured seconds of each module, by its path under the repository (`tests/unit/test_x.py`)."""
    try:
        return {str(k): float(v) for k, v in json.loads(FIGURES.read_text())["seconds"].items()}
    except FileNotFoundError:
        return {}


def order(items: list, seconds: dict[str, float]) -> list:
    """`items` (pytest's, each module's together) with their modules longest first; a stable sort, so the
    tests of a module, and modules of equal seconds, keep their order."""
    return sorted(items, key=lambda item: -seconds.get(_module(item), UNLISTED_SECONDS))


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


def parse(lines) -> dict[str, float]:
    """Each module's seconds (setup, call and teardown of its tests) from pytest's `--durations=0` lines."""
    totals: dict[str, float] = defaultdict(float)
    for line in lines:
        found = _DURATION.match(line)
        if found:
            totals[found.group(2)] += float(found.group(1))
    return dict(totals)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/module_seconds.py PYTEST_OUTPUT  (a run with --durations=0)", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        totals = parse(f)
    if not totals:
        print(f"{argv[0]}: no `--durations=0` lines (run pytest with --durations=0 --durations-min=0)",
              file=sys.stderr)
        return 1
    doc = {"note": "seconds per test module in one measured `make test` run; they only order the modules "
                   "(tests/module_seconds.py)",
           "seconds": {k: round(v, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}}
    FIGURES.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{FIGURES}: {len(totals)} modules, {sum(totals.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
