"""`zocheck-ray bench all --out DIR`: every benchmark, its tables as JSON and Markdown, and the figures.

    zocheck-ray bench all --out benchmarks/results            # the full run (an hour or more on two cores)
    zocheck-ray bench all --out /tmp/results --quick          # a few minutes: small sizes, fewer repeats
    zocheck-ray bench all --out /tmp/results --only waste scaling memory

Runs, in this order, `bench overhead` and `bench recovery` (through their own command
lines, so their defaults and checks apply), then `bench waste --from DIR` (so the
restart and publishing costs measured by those two feed the wasted-time model),
`bench scaling`, `bench memory` and `bench data-parallel`. Writes into DIR:

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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback
from pathlib import Path

from zocheck_ray.bench.common import machine
from zocheck_ray.plotting import missing_reason

BENCHES = ("overhead", "recovery", "waste", "scaling", "memory", "data-parallel")

QUICK = {
    "overhead": ["--params", "1M", "10M", "--min-steps", "2", "--max-steps", "3", "--step-seconds", "1",
                 "--loop-records", "2000", "--ray-calls", "100", "--trainer-steps", "100"],
    "recovery": ["--early-step", "100", "--late-step", "300", "--failures-per-point", "1", "--no-baseline-late",
                 "--big-hidden", "0", "--steps", "100", "--large-failure-step", "20"],
    "waste": {"hidden": 256, "layers": 2, "steps": 3, "trials": 2000},
    "scaling": {"params": [1_000_000, 4_000_000, 16_000_000], "dtypes": ["fp32", "bf16"], "batches": [1, 8],
                "seq_lens": [16, 128], "repeats": 2},
    "memory": {"sizes": [10_000_000, 40_000_000, 80_000_000], "hidden": 512, "layers": 2, "steps": 14},
    "data-parallel": {"steps": 60, "fail_at": 40, "gathers": 300, "rounds": 1},
}
FULL = {
    "overhead": [],
    "recovery": [],
    "waste": {},
    "scaling": {"params": [1_000_000, 4_000_000, 16_000_000, 64_000_000], "dtypes": ["fp32", "bf16", "fp16"],
                "batches": [1, 4, 16], "seq_lens": [16, 64, 256], "repeats": 3},
    "memory": {"sizes": [25_000_000, 50_000_000, 100_000_000, 200_000_000]},
    "data-parallel": {},
}


# --------------------------------------------------------------------------- machine


def describe_machine() -> dict:
    """`bench.common.machine` plus memory, load and the versions of what the figures depend on."""
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


# --------------------------------------------------------------------------- markdown


def md_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec); a missing value prints as '-'."""
    out = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    for r in rows:
        cells = []
        for key, _, spec in columns:
            value = r.get(key)
            cells.append("-" if value is None else format(value, spec))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def waste_markdown(doc: dict) -> str:
    parts = [f"# Wasted time against MTBF\n\nTarget: the best asynchronous baseline wastes >= "
             f"{doc['target_ratio']:g}x more than ZOCheck at every MTBF (the paper: "
             f"{doc['paper_ratio_range'][0]:g}-{doc['paper_ratio_range'][1]:g}x). Ratios leave out the process "
             "restart, which every strategy pays alike; the column 'with restart' keeps it. "
             f"Overall: **{'met' if doc['targets']['met'] else 'missed'}** (required sets: "
             f"{', '.join(doc['targets']['required_sets'])})."]
    for s in doc["sets"]:
        v = s["target"]
        parts.append(f"## {s['name']} ({s['regime']})\n")
        inputs = doc["inputs"][s["name"]]
        parts.append(md_table([{"field": k, "value": e["value"], "source": e["source"]} for k, e in inputs.items()
                               if isinstance(e, dict) and "value" in e],
                              [("field", "input", ""), ("value", "value", ".4g"), ("source", "source", "")]))
        rows = []
        for p in s["points"]:
            by = {r["label"]: r for r in s["rows"] if r["mtbf_hours"] == p["mtbf_hours"]}
            rows.append({**p, "log": by["log-only"]["waste_seconds"],
                         **{f"a{k}": by[f"async-checkpoint K={k}"]["waste_seconds"] for k in (7, 300, 1000)},
                         **{f"s{k}": by[f"sync-checkpoint K={k}"]["waste_seconds"] for k in (7, 300, 1000)}})
        parts.append("\nExpected wasted time per failure window, seconds:\n")
        parts.append(md_table(rows, [
            ("mtbf_hours", "MTBF h", "g"), ("zocheck_seconds", "zocheck", ".4g"), ("zocheck_snapshot_interval", "N", "d"),
            ("log", "log-only", ".4g"), ("s7", "sync K=7", ".4g"), ("s300", "sync K=300", ".4g"),
            ("s1000", "sync K=1000", ".4g"), ("best_sync_seconds", "sync best", ".4g"), ("best_sync_k", "K*", "d"),
            ("a7", "async K=7", ".4g"), ("a300", "async K=300", ".4g"), ("a1000", "async K=1000", ".4g"),
            ("best_async_seconds", "async best", ".4g"), ("best_async_k", "K*", "d"),
            ("best_async_over_zocheck", "best async / zocheck", ".1f"),
            ("best_async_over_zocheck_with_restart", "with restart", ".1f"),
            ("simulated_best_async_over_zocheck", "simulated", ".1f")]))
        parts.append(f"\nTarget {'met' if v['met'] else '**missed**'}: {v['min_ratio']:.1f}-{v['max_ratio']:.1f}x "
                     f"(with the restart {v['min_ratio_with_restart']:.1f}-{v['max_ratio_with_restart']:.1f}x). "
                     f"Why: {v['why']}.\n")
    for name, rows in doc.get("sensitivity", {}).items():
        ends = rows[0]["mtbf_hours"]
        parts.append(f"## Sensitivity of {name} to its stated assumptions\n\nBest async / zocheck, restart "
                     f"excluded, at {ends[0]:g} h and {ends[-1]:g} h, each assumption moved by 2x (or replay after a "
                     "failure done on the GPU):\n")
        parts.append(md_table([{**r, "lo": r["ratios"][0], "hi": r["ratios"][-1]} for r in rows], [
            ("variant", "variant", ""), ("zocheck_snapshot_interval", "N", "d"), ("lo", f"{ends[0]:g} h", ".1f"),
            ("hi", f"{ends[-1]:g} h", ".1f")]) + "\n")
    return "\n".join(parts) + "\n"


def scaling_markdown(doc: dict) -> str:
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


def memory_markdown(doc: dict) -> str:
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


def overhead_markdown(doc: dict) -> str:
    rows = doc.get("results", [])
    targets = doc.get("targets", {})
    return "\n".join([
        "# Critical-path overhead\n",
        md_table(rows, [("params", "params", ","), ("dtype", "dtype", ""), ("zo_step_ms", "ZO step ms", ".1f"),
                        ("publish_us_median", "publish us p50", ".2f"), ("publish_us_p99", "p99", ".2f"),
                        ("ray_call_us_median", "Ray call us", ".0f"), ("staging_copy_ms", "staging copy ms", ".1f"),
                        ("sync_save_ms", "sync save ms", ".0f")]),
        f"\nTargets met: {targets.get('met')}. " + " ".join(targets.get("notes", [])) + "\n"])


def recovery_markdown(doc: dict) -> str:
    rows = []
    for s in doc.get("scenarios", []):
        for p in s.get("points", []):
            rows.append({"scenario": s.get("name"), "params": s.get("params"), "point": p.get("point"), **p})
    targets = doc.get("targets", {})
    return "\n".join([
        "# Recovery after a software failure\n",
        md_table(rows, [("scenario", "scenario", ""), ("params", "params", ","), ("point", "point", ""),
                        ("zocheck_seconds", "zocheck s", ".2f"), ("zocheck_replayed_records", "replayed", ".0f"),
                        ("baseline_seconds", "async ckpt s", ".2f"),
                        ("baseline_recomputed_steps", "recomputed", ".0f"),
                        ("zocheck_over_baseline", "zocheck / ckpt", ".2f")]),
        f"\nTargets met: {targets.get('met')}. " + " ".join(targets.get("notes", [])) + "\n"])


def data_parallel_markdown(doc: dict) -> str:
    from zocheck_ray.bench.data_parallel import markdown

    return markdown(doc)


MARKDOWN = {"waste": waste_markdown, "scaling": scaling_markdown, "memory": memory_markdown,
            "overhead": overhead_markdown, "recovery": recovery_markdown, "data-parallel": data_parallel_markdown}


# --------------------------------------------------------------------------- figures


def _pyplot():
    from zocheck_ray.plotting import pyplot

    return pyplot()


STYLE = {"zocheck": ("tab:green", "o"), "log-only": ("tab:gray", "s"), "sync-checkpoint": ("tab:blue", "^"),
         "async-checkpoint": ("tab:orange", "v")}


def plot_waste(doc: dict, path: Path) -> None:
    plt = _pyplot()
    sets = doc["sets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets), 4.2), squeeze=False)
    for ax, s in zip(axes[0], sets):
        mtbf = [p["mtbf_hours"] for p in s["points"]]
        series = {"zocheck": [p["zocheck_seconds"] for p in s["points"]],
                  "async best K": [p["best_async_seconds"] for p in s["points"]],
                  "sync best K": [p["best_sync_seconds"] for p in s["points"]]}
        for label in ("log-only", "async-checkpoint K=7", "async-checkpoint K=1000"):
            series[label.replace("-checkpoint", "")] = [r["waste_seconds"] for r in s["rows"] if r["label"] == label]
        colors = {"zocheck": "tab:green", "async best K": "tab:orange", "sync best K": "tab:blue",
                  "log-only": "tab:gray", "async K=7": "tab:red", "async K=1000": "tab:brown"}
        for label, values in series.items():
            ax.plot(mtbf, values, marker="o", ms=3, label=label, color=colors[label],
                    lw=2.2 if label == "zocheck" else 1.2)
        ax.set_yscale("log")
        ax.set_xlabel("MTBF (hours)")
        ax.set_title(f"{s['name']}\nbest async / zocheck {s['target']['min_ratio']:.1f}-{s['target']['max_ratio']:.1f}x",
                     fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("expected wasted time per failure window (s)")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tradeoff(doc: dict, path: Path, mtbf_hours: float | None = None) -> None:
    """Per strategy and K: critical-path overhead per failure window against recovery per failure."""
    plt = _pyplot()
    sets = doc["sets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets), 4.2), squeeze=False)
    for ax, s in zip(axes[0], sets):
        hours = sorted({r["mtbf_hours"] for r in s["rows"]})
        m = mtbf_hours if mtbf_hours in hours else hours[len(hours) // 2]
        for r in (r for r in s["rows"] if r["mtbf_hours"] == m):
            color, marker = STYLE[r["strategy"]]
            x = max(r["overhead_seconds"], 1e-6)
            y = max(r["recovery_seconds"] - s["timings"]["restart_seconds"], 1e-6)
            ax.scatter([x], [y], color=color, marker=marker, s=60 if r["strategy"] == "zocheck" else 30)
            ax.annotate(r["label"].replace("-checkpoint", "").replace("best ", "*"), (x, y), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"critical-path overhead per failure window (s), MTBF {m:g} h")
        ax.set_title(s["name"], fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("recovery per failure, restart excluded (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scaling(doc: dict, path: Path) -> None:
    plt = _pyplot()
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


def plot_memory(doc: dict, path: Path) -> None:
    plt = _pyplot()
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


FIGURES = {"waste": [("waste.png", plot_waste), ("tradeoff.png", plot_tradeoff)],
           "scaling": [("scaling.png", plot_scaling)], "memory": [("memory.png", plot_memory)]}


# --------------------------------------------------------------------------- running


def _run_cli_bench(name: str, argv: list[str], out: Path) -> dict:
    from zocheck_ray.cli import main

    path = out / f"{name}.json"
    code = main(["bench", name, *argv, "--json", str(path)])
    if not path.is_file():
        raise RuntimeError(f"bench {name} exited {code} without writing {path}")
    return json.loads(path.read_text())


def run_bench(name: str, out: Path, quick: bool) -> dict:
    options = (QUICK if quick else FULL)[name]
    path = str(out / f"{name}.json")
    if name in ("overhead", "recovery"):
        return _run_cli_bench(name, options, out)
    if name == "waste":
        from zocheck_ray.bench.waste import waste_benchmark

        have = any((out / f).is_file() for f in ("overhead.json", "recovery.json"))
        return waste_benchmark(from_dir=str(out) if have else None, from_required=False, json_path=path, **options)
    if name == "scaling":
        import numba

        from zocheck_ray.bench.scaling import scaling_benchmark

        threads = sorted({1, numba.config.NUMBA_NUM_THREADS})
        return scaling_benchmark(options["params"], threads, options["dtypes"], options["batches"],
                                 options["seq_lens"], options["repeats"], json_path=path)
    if name == "memory":
        from zocheck_ray.bench.memory import memory_benchmark

        return memory_benchmark(json_path=path, **options)
    if name == "data-parallel":
        from zocheck_ray.bench.data_parallel import data_parallel_benchmark

        return data_parallel_benchmark(json_path=path, **options)
    raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHES)}")


def _verdicts(name: str, doc: dict) -> list[str]:
    if name == "waste":
        return [f"wasted time, best async / zocheck >= {doc['target_ratio']:g}x at every MTBF: "
                f"{'met' if doc['targets']['met'] else 'missed'}; "
                + "; ".join(f"{s['name']} {s['target']['min_ratio']:.1f}-{s['target']['max_ratio']:.1f}x"
                            for s in doc["sets"])
                + f" (the paper: {doc['paper_ratio_range'][0]:g}-{doc['paper_ratio_range'][1]:g}x)"]
    if name == "scaling":
        b = doc["batch"]
        return [f"replay independent of batch size and sequence length: {b['independent']} (trainer step "
                f"{b['trainer_spread']:.1f}x over the grid, replay {b['replay_spread']:.2f}x)"]
    if name == "memory":
        return [f"{k.replace('_', ' ')}: {v}" for k, v in doc["invariants"].items()]
    if name == "recovery":
        return _recovery_verdicts(doc.get("targets", {}))
    if name == "data-parallel":
        t, rec = doc["targets"], doc["recovery_seconds"]
        return [f"all-gather <= 1 ms: {t['collective_under_1ms']} ({doc['collective']['median_seconds'] * 1e3:.3f} ms); "
                f"k=2 steps/s within 20% of k=1: {t['weak_scaling_within_20pct']} ({doc['weak_scaling_ratio']:.2f}x); "
                f"rank recovery no slower than k=1: {t['rank_recovery_no_slower']} ({rec['k2']:.2f} s vs "
                f"{rec['k1']:.2f} s); exact: {t['exact']}"]
    targets = doc.get("targets", {})
    return [f"targets met: {targets.get('met')}"] + [f"note: {n}" for n in targets.get("notes", [])]


def _recovery_verdicts(targets: dict) -> list[str]:
    def verdict(met) -> str:
        return {True: "met", False: "missed", None: "not run"}[met]

    lines = []
    c = targets.get("comparison")
    if c:
        for key, what in (("over_async_k7", "async K=7"), ("over_log_only", "log-only at 80% of a 5,000-step run")):
            t = c[key]
            ratios = "; ".join(f"{name}: restore {v['restore']:.2f}x, + catch-up {v['work']:.2f}x, in total "
                               f"{v['total']:.2f}x" + ("" if v["applicable"] else " (not checked)")
                               for name, v in t["ratios"].items() if v["restore"] is not None)
            lines.append(f"software-failure recovery >= {t['target']:g}x faster than {what} on the restore "
                         f"(>= {t['min_params']:,} parameters): {verdict(t['met'])} ({ratios})")
        lines.append(f"every recovered state equals the uninterrupted run's: {c['states_equal']}")
    depth = targets.get("independent_of_depth", {})
    if depth.get("met") is not None:
        lines.append(f"recovery independent of how far training has gone: {verdict(depth['met'])} (late/early "
                     + ", ".join(f"{k} {v:.2f}" for k, v in depth.get("late_over_early", {}).items()) + ")")
    faster = targets.get("faster_than_async_checkpoint", {})
    if faster.get("met") is not None:
        lines.append("total recovery (process start included) faster than async K=7 at every depth point: "
                     f"{verdict(faster['met'])} (zocheck/checkpoint "
                     + ", ".join(f"{k} {v:.2f}" for k, v in faster.get("zocheck_over_baseline", {}).items()) + ")")
    notes = [*targets.get("notes", []), *(c.get("notes", []) if c else [])]
    return lines + [f"note: {n}" for n in notes]


def write_outputs(docs: dict, out: Path, info: dict, errors: dict | None = None, quick: bool = False) -> list[Path]:
    """Markdown per benchmark, the figures, machine.json and summary.md; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    errors = errors or {}
    written, left_out = [], []
    no_plots = missing_reason()  # the tables and JSON need no matplotlib; only the figures do
    for name, doc in docs.items():
        path = out / f"{name}.md"
        path.write_text(MARKDOWN[name](doc))
        written.append(path)
        for filename, plot in FIGURES.get(name, []):
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
            lines.extend(f"- **{name}**{when}: {v}" for v in _verdicts(name, docs[name]))
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
            docs[name] = run_bench(name, out, quick)
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


def register(commands, bench) -> None:
    parser = bench.add_parser("all", help="every benchmark: JSON, Markdown and PNG figures into --out DIR",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, metavar="DIR", help="where the results go")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats: a few minutes")
    parser.add_argument("--only", nargs="+", metavar="BENCH", help=f"run only these of {', '.join(BENCHES)}")
    parser.set_defaults(func=run)
