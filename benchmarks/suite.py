"""`python -m benchmarks all --out DIR`: every benchmark, its tables as JSON and Markdown, and the figures.

    python -m benchmarks all --out benchmarks/results            # the full run (an hour or more on two cores)
    python -m benchmarks all --out /tmp/results --quick          # a few minutes: small sizes, fewer repeats
    python -m benchmarks all --out /tmp/results --only waste scaling memory

Runs, in this order, `bench overhead` and `bench recovery` (through their own command
lines, so their defaults and checks apply), then `bench waste --from DIR` (so the
restart and publishing costs measured by those two feed the wasted-time model),
`bench scaling`, `bench memory`, `bench data-parallel` and `bench scale`. Writes into DIR:

- `<bench>.json` (each benchmark's own document) and `<bench>.md` (its tables);
- `machine.json`: CPU model, cores, memory, load average before and after, versions;
- `tradeoff.png` (critical-path overhead against recovery time per failure, one point per
  strategy and K, the paper's trade-off figure), `waste.png` (wasted time against MTBF per
  strategy, one panel per parameter set), `scaling.png` (replay time against parameter
  count, and against tokens per batch next to the trainer step), `memory.png`;
- `summary.md`: the machine, every target with its verdict, links to the tables and figures.

The figures need matplotlib (`pip install 'zocheck-ray[bench]'`); without it the tables,
JSON and summary are written all the same and the summary names the figures left out.

A benchmark that fails is reported in the summary with its error; the others still run. A
benchmark not run this time (`--only`) whose JSON is already in DIR is summarised from it,
marked as from an earlier run.

Each benchmark of the suite owns its part: `run_in_suite(out, quick)` runs it, `markdown(doc)`
renders its tables, `FIGURES` draws its figures and `verdicts(doc)` states its targets for the
summary. This module only runs them in order and writes the machine and the summary.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import time
import traceback
from pathlib import Path
from types import ModuleType

from benchmarks.common import machine, missing_reason

SUITE = {"overhead": "benchmarks.overhead", "recovery": "benchmarks.recovery", "waste": "benchmarks.waste",
         "scaling": "benchmarks.scaling", "memory": "benchmarks.memory", "data-parallel": "benchmarks.data_parallel",
         "scale": "benchmarks.scale"}
"""The benchmarks of `bench all`, in the order they run (waste reads what overhead and recovery measured)."""
BENCHES = tuple(SUITE)


def benchmark(name: str) -> ModuleType:
    """The module of the suite's benchmark `name` (imported on first use: several start Ray)."""
    return importlib.import_module(SUITE[name])


# --------------------------------------------------------------------------- machine


def describe_machine() -> dict:
    """`common.machine` plus memory, load and the versions of what the figures depend on."""
    import importlib.metadata as md

    info = machine()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        info["memory_bytes"] = None
    info["load_average"] = list(os.getloadavg())
    info["hostname_kind"] = platform.machine()
    versions = {}
    for package in ("torch", "numba", "numpy", "ray", "transformers", "safetensors", "pydantic", "matplotlib"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            versions[package] = None
    info["versions"] = versions
    info["time_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return info


# --------------------------------------------------------------------------- outputs


def write_outputs(docs: dict, out: Path, info: dict, errors: dict | None = None, quick: bool = False) -> list[Path]:
    """Markdown per benchmark, the figures, machine.json and summary.md; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    errors = errors or {}
    written, left_out = [], []
    no_plots = missing_reason()  # the tables and JSON need no matplotlib; only the figures do
    for name, doc in docs.items():
        path = out / f"{name}.md"
        path.write_text(benchmark(name).markdown(doc))
        written.append(path)
        for filename, plot in getattr(benchmark(name), "FIGURES", []):
            if no_plots:
                left_out.append(filename)
                continue
            plot(doc, out / filename)
            written.append(out / filename)
    (out / "machine.json").write_text(json.dumps(info, indent=2) + "\n")
    written.append(out / "machine.json")
    mem = info.get("memory_bytes")
    lines = [
        "# zocheck-ray benchmark results\n",
        f"Run {info.get('time_utc')} ({'quick' if quick else 'full'}) on {info['cpu']}, {info['cpu_count']} cores, "
        + (f"{mem / 2**30:.0f} GiB memory, " if mem else "")
        + f"load average {info['load_average'][0]:.2f} at the start and "
        f"{(info.get('load_average_after') or [float('nan')])[0]:.2f} at the end; CUDA: {info.get('cuda') or 'none'}; Python {info['python']}, "
        + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v) + ".\n",
        "Every figure is compared with a baseline measured in the same run; on a shared machine the absolute "
        "times move with the load, the ratios much less.\n", "## Targets\n"]
    reused = info.get("reused_from_earlier_runs", [])
    for name in BENCHES:
        if name in docs:
            when = (f" (from an earlier run, on {docs[name].get('machine', {}).get('cpu', '?')} with load average "
                    f"{(docs[name].get('machine', {}).get('load_average_before') or ['?'])[0]})" if name in reused else "")
            lines.extend(f"- **{name}**{when}: {v}" for v in benchmark(name).verdicts(docs[name]))
        elif name in errors:
            lines.append(f"- **{name}**: did not complete: {errors[name]}")
    if left_out:
        lines.append(f"\nFigures not drawn ({', '.join(left_out)}): {no_plots}.")
    lines.append("\n## Tables and figures\n")
    lines.extend(f"- [{p.name}]({p.name})" for p in written if p.suffix in (".md", ".png"))
    lines.extend(f"\n![{p.stem}]({p.name})" for p in written if p.suffix == ".png")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    written.append(out / "summary.md")
    return written


def bench_all(out: str | os.PathLike, quick: bool = False, only: list[str] | None = None, say=print) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    info = describe_machine()
    names = [n for n in BENCHES if not only or n in only]
    docs, errors = {}, {}
    for name in names:
        say(f"\n===== bench {name} {'(quick)' if quick else ''} =====")
        started = time.perf_counter()
        try:
            docs[name] = benchmark(name).run_in_suite(out, quick)
        except Exception as error:  # one failed benchmark must not lose the others' results
            errors[name] = f"{type(error).__name__}: {error}".splitlines()[0]
            say(traceback.format_exc())
        say(f"===== bench {name}: {time.perf_counter() - started:.0f} s =====")
    reused = []
    for name in BENCHES:  # so the summary covers every benchmark: earlier results in DIR, marked as such
        path = out / f"{name}.json"
        if name not in docs and name not in errors and path.is_file():
            docs[name] = json.loads(path.read_text())
            reused.append(name)
    info["load_average_after"] = list(os.getloadavg())
    info["reused_from_earlier_runs"] = reused
    written = write_outputs(docs, out, info, errors, quick)
    say(f"\nwrote {len(written)} files to {out}: " + ", ".join(p.name for p in written))
    no_plots = missing_reason()
    if no_plots:
        say(f"no figures: {no_plots}")
    return {"docs": docs, "errors": errors, "written": [str(p) for p in written]}


def run(args: argparse.Namespace) -> int:
    unknown = [n for n in args.only or [] if n not in BENCHES]
    if unknown:
        raise SystemExit(f"--only: unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHES)}")
    result = bench_all(args.out, args.quick, args.only)
    return 1 if result["errors"] else 0


def register(bench) -> None:
    parser = bench.add_parser("all", help="every benchmark: JSON, Markdown and PNG figures into --out DIR",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, metavar="DIR", help="where the results go")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats: a few minutes")
    parser.add_argument("--only", nargs="+", metavar="BENCH", help=f"run only these of {', '.join(BENCHES)}")
    parser.set_defaults(func=run)
