"""`python -m benchmarks recovery`: recovery time, ZOCheck against every checkpointing strategy,
on a real local Ray instance.

    python -m benchmarks recovery --json benchmarks/results/recovery.json
    python -m benchmarks recovery --no-depth --steps 1000 --large-failure-step 20 --json recovery-quick.json

Three parts, each measured side by side in one run:

- `comparison` (the published comparison; `benchmarks.recovery_comparison`): every strategy of
  `benchmarks.baselines` (log-only; log + sync and async full checkpoints at K = 7, 300, 1000;
  zocheck), a software and a host failure at 80% of a `--steps` run (default 5000) of
  `--comparison-model`, the replayed steps, and each recovered state's hash against the
  uninterrupted run's.
- `large`: a >= 10M-parameter OPT (`--large-hidden 512`: ~14M) failing at
  `--large-failure-step`: zocheck against async K=7 and log-only; log-only's replay is also
  sampled at several record counts and extrapolated linearly to 80% of a 5 000-step run
  (labelled "extrapolated"), as replaying thousands of records of that model takes too long here.
- `depth` (scenarios): zocheck's software-failure recovery around step 100 and around step
  10 000 (independent of how far training has gone: within 20%), side by side with async
  K=7 at the same failure steps. Each point is several failures (`log_interval` = 10 steps
  apart, the late ones in the same phases modulo K as the early ones) and reports medians.

Recovery is timed from the driver seeing the failure until the trainer is back at the failed
step, and broken down: `restore_seconds` (image or checkpoint plus records -> state, inside
the restarted trainer), `catch_up_seconds` (recomputing the steps whose records were still
unsent when the process died: the trainer publishes every 100 ms and at each segment's end, so
a failure loses the records of up to 100 ms, for every strategy alike), `process_seconds` (the restarted trainer's
constructor, which also builds the model, plus the catch-up), and the total, which adds
Ray's start of the process. The comparison's targets are checked on the restore, the part a
strategy decides (every strategy loses the same unsent records and starts the same process);
restore + catch-up (`work_seconds`) and the totals are reported beside. The restarted
trainer loads its replay kernel while its model is built, so no restore pays for that.

JSON (keys stable): {"benchmark": "recovery", "machine" (`common.machine()` + load averages),
"checkpoint_every", "log_interval", "scenarios": [depth scenarios, see `run_scenario`],
"comparisons": {"comparison": ..., "large": ...} (see `benchmarks.recovery_comparison`),
"targets": {"independent_of_depth", "faster_than_async_checkpoint", "comparison"
(`check_comparison_targets`: over_async_k7, over_log_only, states_equal, met, notes), "met",
"notes"}}.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray

from benchmarks.baselines import CHECKPOINT_EVERY, PAPER_INTERVALS, Strategy, paper_strategies
from benchmarks.common import (bench_job, machine, md_table, print_table, run_command_for_json, save_opt,
                               write_json)
from benchmarks.failures import run_with_failures, run_zocheck
from benchmarks.recovery_comparison import ComparisonSpec, check_comparison_targets, print_comparison
from zocheck_ray.workload.models import build_model, trainable_parameters

DEPTH_TOLERANCE = 0.20
"""Recovery late vs early: within 20%."""
TAIL_STEPS = 10
"""Steps trained after the last failure."""


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    """A built-in small model or a saved model directory."""
    params: int
    points: dict[str, list[int]]
    """Point name ('early', 'late') -> the failure steps measured there."""
    baseline_points: tuple[str, ...] | None = None
    """Points the baseline is measured at too (None: all); it trains only as far as they need."""

    @property
    def failures(self) -> list[int]:
        return sorted(s for steps in self.points.values() for s in steps)

    @property
    def baseline_failures(self) -> list[int]:
        names = self.points if self.baseline_points is None else self.baseline_points
        return sorted(s for name in names for s in self.points[name])


def failure_steps(step: int, count: int, spacing: int = 10, period: int | None = None,
                  align_to: int | None = None) -> list[int]:
    """`count` failures `spacing` steps apart, from the first multiple of `spacing` at or after
    `step`; with `align_to`, moved up to the same phase as `align_to` modulo `period` (by default
    lcm(K, spacing): the same checkpoint distances at both points).

    With `spacing` equal to the controller's `log_interval`, a failure step ends a segment,
    so the catch-up after its recovery is one segment, timed from the progress lines.
    """
    step = -(-step // spacing) * spacing
    if align_to is not None:
        period = period or math.lcm(CHECKPOINT_EVERY, spacing)
        step += (align_to - step) % period
    return [step + spacing * i for i in range(count)]


def count_params(model: str) -> int:
    return sum(p.numel() for _, p in trainable_parameters(build_model(model)))


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_scenario(scenario: Scenario, storage: str, every: int = CHECKPOINT_EVERY, snapshot_interval: int | None = None,
                 log_interval: int = 10, say=print) -> dict:
    """Both systems on one job, failing at the same steps; per-point medians and ratios."""
    failures = scenario.failures
    job = bench_job(model=scenario.model, steps=failures[-1] + TAIL_STEPS, storage=storage,
                    run_id=f"bench-recovery-{scenario.name}-{uuid.uuid4().hex[:6]}",
                    shadow={"snapshot_interval": snapshot_interval}, log_interval=log_interval,
                    failure={"max_restarts": len(failures) + 2})
    say(f"  {scenario.name}: {scenario.params:,} parameters, {job.steps:,} steps, failures at {failures}")
    say("    zocheck ...")
    summary, zocheck = run_zocheck(job, failures)
    step_seconds = summary.trainer_seconds_per_step
    baseline_failures = scenario.baseline_failures
    baseline_job = job.model_copy(update={"steps": baseline_failures[-1] + TAIL_STEPS})
    say(f"    async checkpoint every {every} steps, {baseline_job.steps:,} steps, failures at {baseline_failures} ...")
    baseline = run_with_failures(baseline_job, Strategy("async", every), baseline_failures,
                                 url=os.path.join(storage, job.run_id + "-async"))
    points = []
    for name, steps in scenario.points.items():
        z = _median([r["seconds_to_failure_step"] for r in zocheck if r["failed_at_step"] in steps])
        b = _median([r["seconds"] for r in baseline["recoveries"] if r["failed_at_step"] in steps])
        points.append({"point": name, "failure_steps": steps, "zocheck_seconds": z, "baseline_seconds": b,
                       "zocheck_over_baseline": z / b if b is not None else None,
                       "zocheck_process_seconds": _median([v for v in _at(zocheck, steps, "process_seconds")
                                                           if v is not None]),
                       "baseline_process_seconds": _median(_at(baseline["recoveries"], steps, "process_seconds")),
                       "zocheck_replayed_records": _median([r["replayed_records"] for r in zocheck
                                                            if r["failed_at_step"] in steps]),
                       "baseline_recomputed_steps": _median([r["recomputed_steps"] for r in baseline["recoveries"]
                                                             if r["failed_at_step"] in steps]),
                       "baseline_replayed_records": _median(_at(baseline["recoveries"], steps, "replayed_records"))})
    by_point = {p["point"]: p for p in points}
    late_over_early = None
    if "early" in by_point and "late" in by_point:
        late_over_early = {k: by_point["late"][f"{k}_seconds"] / by_point["early"][f"{k}_seconds"]
                           for k in ("zocheck", "baseline", "zocheck_process", "baseline_process")
                           if by_point["late"][f"{k}_seconds"] and by_point["early"][f"{k}_seconds"]}
    return {
        "name": scenario.name, "model": scenario.model, "params": scenario.params, "steps": job.steps,
        "failures": failures, "points": points, "late_over_early": late_over_early,
        "zocheck": {"recoveries": zocheck, "trainer_seconds_per_step": step_seconds,
                    "snapshot_interval": summary.snapshot_interval, "publish_us_median": summary.publish_us_median,
                    "final_state_hash": summary.final_state_hash, "shadow_state_hash": summary.shadow_state_hash},
        "baseline": baseline,
        # Both systems train the same steps from the same seeds: equal bits, unless the baseline stopped earlier.
        "final_states_equal": (summary.final_state_hash == summary.shadow_state_hash == baseline["final_state_hash"]
                               if baseline["steps"] == summary.steps else None),
    }


def _at(recoveries: list[dict], steps: list[int], key: str) -> list[float]:
    return [r[key] for r in recoveries if r["failed_at_step"] in steps]


def _range(values: list[float]) -> float:
    return max(values) - min(values) if values else 0.0


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def check_targets(results: list[dict]) -> dict:
    """Recovery independent of depth (within 20%), and faster than the baseline at every point;
    `notes` says why a target was missed, from the measured breakdown."""
    notes, depth_ratios, faster, ratios = [], {}, [], {}
    for s in results:
        zocheck, baseline = s["zocheck"]["recoveries"], s["baseline"]["recoveries"]
        by_point = {p["point"]: p for p in s["points"]}
        if s["late_over_early"] is not None:
            ratio = s["late_over_early"]["zocheck"]
            depth_ratios[s["name"]] = ratio
            if abs(ratio - 1) > DEPTH_TOLERANCE:
                early, late = by_point["early"], by_point["late"]
                spread = max(_range(_at(zocheck, p["failure_steps"], "seconds_to_failure_step")) for p in (early, late))
                notes.append(
                    f"{s['name']}: late/early = {ratio:.2f}, outside 1 +- {DEPTH_TOLERANCE:g}. Inside the restarted "
                    f"process the recovery took {_fmt(early.get('zocheck_process_seconds'))} early and "
                    f"{_fmt(late.get('zocheck_process_seconds'))} late ({early['zocheck_replayed_records']:.0f} and "
                    f"{late['zocheck_replayed_records']:.0f} records replayed); the rest is Ray restarting the "
                    f"process, and repeated failures at one point already differ by up to {spread:.2f} s")
        for p in s["points"]:
            if p["zocheck_over_baseline"] is None:
                continue  # the baseline was not run to this point
            faster.append(p["zocheck_over_baseline"] < 1)
            ratios[f"{s['name']}/{p['point']}"] = p["zocheck_over_baseline"]
            if p["zocheck_over_baseline"] < 1:
                continue
            steps = p["failure_steps"]
            noise = max(_range(_at(zocheck, steps, "seconds_to_failure_step")), _range(_at(baseline, steps, "seconds")))
            diff = p["zocheck_seconds"] - p["baseline_seconds"]
            note = (f"{s['name']} {p['point']}: zocheck {p['zocheck_seconds']:.2f} s vs async checkpoint "
                    f"{p['baseline_seconds']:.2f} s; inside the restarted process "
                    f"{_fmt(p.get('zocheck_process_seconds'))} (replay of {p['zocheck_replayed_records']:.0f} records "
                    f"and catch-up) vs {_fmt(p.get('baseline_process_seconds'))} (load "
                    f"{_median(_at(baseline, steps, 'load_seconds')):.2f} s, replay of "
                    f"{_median(_at(baseline, steps, 'replayed_records')):.0f} logged records, recompute of "
                    f"{p['baseline_recomputed_steps']:.0f} steps "
                    f"{_median(_at(baseline, steps, 'recompute_seconds')):.2f} s)")
            if diff <= noise:
                note += (f"; the {diff:.2f} s difference is within the repeats' spread ({noise:.2f} s), which comes "
                         "from Ray's restart of the process")
            notes.append(note)
    independent = bool(depth_ratios) and all(abs(r - 1) <= DEPTH_TOLERANCE for r in depth_ratios.values())
    return {"independent_of_depth": {"met": independent, "late_over_early": depth_ratios,
                                     "tolerance": DEPTH_TOLERANCE},
            "faster_than_async_checkpoint": {"met": bool(faster) and all(faster), "zocheck_over_baseline": ratios},
            "met": independent and bool(faster) and all(faster), "notes": notes}


def recovery_benchmark(scenarios: list[Scenario], storage: str | None = None, every: int = CHECKPOINT_EVERY,
                       snapshot_interval: int | None = None, log_interval: int = 10, json_path: str | None = None,
                       say=print, comparisons: list[ComparisonSpec] = ()) -> dict:
    """Run the scenarios and comparisons, print the tables, check the targets; returns the JSON document.

    Keys: benchmark, machine (`common.machine()` + load_average_before/after), checkpoint_every,
    log_interval, scenarios (see `run_scenario`), comparisons {name: `compare_recovery` document},
    targets {independent_of_depth {met, late_over_early, tolerance}, faster_than_async_checkpoint
    {met, zocheck_over_baseline by "scenario/point"}, comparison (`check_comparison_targets`, or
    None without comparisons), met, notes}.
    """
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", num_cpus=max(3, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    storage_dir = storage or tempfile.mkdtemp(prefix="zocheck-bench-recovery-")
    info = machine()
    load_before = list(os.getloadavg())
    say(f"recovery benchmark: {info['cpu']}, {info['cpu_count']} cores, load average {load_before[0]:.1f}")
    try:
        results = [run_scenario(s, storage_dir, every, snapshot_interval, log_interval, say) for s in scenarios]
        compared = {c.name: c.run(storage_dir, log_interval, snapshot_interval, say) for c in comparisons}
    finally:
        if storage is None:
            shutil.rmtree(storage_dir, ignore_errors=True)
        if started_ray:
            ray.shutdown()
    rows = []
    for s in results:
        for p in s["points"]:
            steps = p["failure_steps"]
            rows.append({"scenario": s["name"], "params": s["params"], "point": p["point"],
                         "steps": ",".join(map(str, steps)), "z": p["zocheck_seconds"],
                         "z_in": p["zocheck_process_seconds"], "replayed": p["zocheck_replayed_records"],
                         "b": p["baseline_seconds"], "b_in": p["baseline_process_seconds"],
                         "recomputed": p["baseline_recomputed_steps"], "ratio": p["zocheck_over_baseline"]})
    if rows:
        say("")
        print_table(rows, [
            ("scenario", "scenario", ""), ("params", "params", ","), ("point", "point", ""),
            ("steps", "failed at", ""), ("z", "zocheck s", ".2f"), ("z_in", "in process", ".2f"),
            ("replayed", "replayed", ".0f"), ("b", "async ckpt s", ".2f"), ("b_in", "in process", ".2f"),
            ("recomputed", "recomputed", ".0f"), ("ratio", "zocheck/ckpt", ".2f"),
        ])
        say("(seconds from the driver seeing the failure to the trainer back at the failed step, medians; 'in "
            "process':\n the restarted trainer's constructor plus the steps it recomputed, i.e. without Ray's restart "
            "itself)")
    for s in results:
        if s["late_over_early"]:
            baseline = s["late_over_early"].get("baseline")
            inside = s["late_over_early"].get("zocheck_process")
            say(f"\n{s['name']}: recovery late/early = {s['late_over_early']['zocheck']:.2f} (zocheck"
                + (f"; {inside:.2f} inside the restarted process)" if inside is not None else ")")
                + (f", {baseline:.2f} (async checkpoint)" if baseline is not None else ""))
        if s["final_states_equal"] is False:
            say(f"{s['name']}: WARNING the two systems ended in different states")
    for name, c in compared.items():
        print_comparison(name, c, say)
    targets = check_targets(results) if results else {
        "independent_of_depth": {"met": None, "late_over_early": {}, "tolerance": DEPTH_TOLERANCE},
        "faster_than_async_checkpoint": {"met": None, "zocheck_over_baseline": {}}, "met": True, "notes": []}
    targets["comparison"] = check_comparison_targets(compared) if compared else None
    if compared:
        c = targets["comparison"]
        def ratios(key: str, digits: int) -> str:
            return ", ".join(
                f"{k}: restore {v['restore']:.{digits}f}x, + catch-up {v['work']:.{digits}f}x, in total "
                f"{v['total']:.{digits}f}x" + (" extrapolated" if v.get("extrapolated") else "")
                + ("" if v["applicable"] else " (not checked: < 10M parameters or early failure)")
                for k, v in c[key]["ratios"].items() if v["restore"] is not None)

        say(f"\nsoftware-failure recovery >= {c['over_async_k7']['target']}x faster than async K=7 on the restore, "
            f">= {c['over_async_k7']['min_params']:,} parameters: {'met' if c['over_async_k7']['met'] else 'missed'} "
            f"({ratios('over_async_k7', 2)})")
        say(f">= {c['over_log_only']['target']:g}x faster than log-only at 80% of a {c['over_log_only']['run_steps']:,}"
            f"-step run, >= {c['over_log_only']['min_params']:,} parameters: "
            f"{'met' if c['over_log_only']['met'] else 'missed'} ({ratios('over_log_only', 1)})")
        say("  (restore: image or checkpoint + records -> state, what the strategy decides; catch-up and the "
            "process start are the same for every strategy)")
        for note in c["notes"]:
            say(f"  why: {note}")
        targets["met"] = targets["met"] and c["met"]
    if not results:
        say("\nrecovery independent of depth: not run (--no-depth)")
        targets["met"] = bool(compared) and targets["met"]
    if results:
        say(f"\nrecovery independent of depth (within {DEPTH_TOLERANCE:.0%}): "
            f"{'met' if targets['independent_of_depth']['met'] else 'missed'}")
        faster = targets["faster_than_async_checkpoint"]
        say(f"faster than an async full checkpoint every {every} steps at every point: "
            f"{'met' if faster['met'] else 'missed'} (zocheck/checkpoint: "
            + ", ".join(f"{k} {v:.2f}" for k, v in faster["zocheck_over_baseline"].items()) + ")")
        for note in targets["notes"]:
            say(f"  why: {note}")
    doc = {"benchmark": "recovery", "machine": {**info, "load_average_before": load_before,
                                                "load_average_after": list(os.getloadavg())},
           "checkpoint_every": every, "log_interval": log_interval, "scenarios": results, "comparisons": compared,
           "targets": targets}
    write_json(json_path, doc)
    return doc


def default_scenarios(args: argparse.Namespace, model_dir: str) -> list[Scenario]:
    k, spacing = args.failures_per_point, args.log_interval
    period = math.lcm(args.checkpoint_every, spacing)
    early = failure_steps(args.early_step, k, spacing)
    scenarios = []
    if not args.no_depth:
        late = failure_steps(args.late_step, k, spacing, period, align_to=early[0])
        scenarios.append(Scenario("depth", args.model, count_params(args.model), {"early": early, "late": late},
                                  ("early",) if args.no_baseline_late else None))
    if args.big_hidden:
        path, params = save_opt(os.path.join(model_dir, "big-opt"), args.big_hidden, args.big_layers)
        points = {"early": early}
        if args.big_late_step:
            points["late"] = failure_steps(args.big_late_step, k, spacing, period, align_to=early[0])
        scenarios.append(Scenario("big", path, params, points, ("early",) if args.no_baseline_late else None))
    return scenarios


def default_comparisons(args: argparse.Namespace, model_dir: str) -> list[ComparisonSpec]:
    """`comparison`: every strategy at 80% of `--steps` on `--comparison-model`; `large`: a
    >= 10M-parameter OPT, zocheck against async K=7 and log-only (sampled and extrapolated)."""
    out = []
    spacing = args.log_interval
    if args.steps:
        failure = max(spacing, round(0.8 * args.steps / spacing) * spacing)
        out.append(ComparisonSpec("comparison", args.comparison_model, count_params(args.comparison_model), failure,
                                  tuple(paper_strategies(tuple(args.intervals))), tuple(args.modes), args.steps))
    if args.large_hidden:
        path, params = save_opt(os.path.join(model_dir, "large-opt"), args.large_hidden, args.large_layers)
        failure = -(-args.large_failure_step // spacing) * spacing
        samples = tuple(sorted({max(1, failure // 4), max(1, failure // 2), failure}))
        out.append(ComparisonSpec("large", path, params, failure,
                                  (Strategy("log-only"), Strategy("async", CHECKPOINT_EVERY), Strategy("zocheck")),
                                  ("software",), args.large_run_steps, samples, int(0.8 * args.large_run_steps)))
    return out


def run_cli(args: argparse.Namespace) -> int:
    if args.log_interval < 1 or args.failures_per_point < 1 or args.checkpoint_every < 1:
        raise SystemExit("--log-interval, --failures-per-point and --checkpoint-every must be at least 1")
    if args.early_step <= 0 or args.late_step <= args.early_step + args.log_interval * args.failures_per_point:
        raise SystemExit("--late-step must lie after --early-step and its failures (--log-interval steps apart)")
    model_dir = tempfile.mkdtemp(prefix="zocheck-bench-models-")
    try:
        doc = recovery_benchmark(default_scenarios(args, model_dir), args.storage, args.checkpoint_every,
                                 args.snapshot_interval, args.log_interval, args.json,
                                 comparisons=default_comparisons(args, model_dir))
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    return 0 if doc["targets"]["met"] else 1


# ------------------------------------------------------------ in `bench all`: options, tables, figures, verdicts

SUITE_ARGS = {
    "quick": ["--early-step", "100", "--late-step", "300", "--failures-per-point", "1", "--no-baseline-late",
              "--big-hidden", "0", "--steps", "100", "--large-failure-step", "20"],
    "full": [],
}
"""Command-line arguments of `bench all`'s run (`--quick` or not)."""


def run_in_suite(out: Path, quick: bool) -> dict:
    """`bench all`'s run: through the command line, so its defaults and checks apply; the JSON in `out`."""
    return run_command_for_json(register, "recovery", SUITE_ARGS["quick" if quick else "full"], out / "recovery.json")


def markdown(doc: dict) -> str:
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


def verdicts(doc: dict) -> list[str]:
    """The summary's lines for this benchmark's targets."""
    targets = doc.get("targets", {})

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


def register(bench) -> None:
    parser = bench.add_parser("recovery", help="software-failure recovery: early vs late, vs async full checkpoints",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-opt", help="model of the depth scenario (default tiny-opt)")
    parser.add_argument("--early-step", type=int, default=100, help="first early failure (default 100)")
    parser.add_argument("--late-step", type=int, default=10_000, help="first late failure (default 10000)")
    parser.add_argument("--failures-per-point", type=int, default=3, help="failures measured per point (default 3)")
    parser.add_argument("--no-depth", action="store_true", help="skip the depth scenario")
    parser.add_argument("--no-baseline-late", action="store_true",
                        help="measure the baseline at the early failures only, so it trains ~130 steps, not ~10 000 "
                             "(its recovery cannot depend on depth: its newest persisted checkpoint is < 2K steps "
                             "back)")
    parser.add_argument("--big-hidden", type=int, default=0,
                        help="hidden size of an OPT failed early as in the depth scenario (e.g. 512: ~14M parameters; "
                             "default 0 skips it: the `large` comparison covers that size)")
    parser.add_argument("--big-layers", type=int, default=4, help="layers of the big scenario's OPT (default 4)")
    parser.add_argument("--big-late-step", type=int, default=0, help="also fail the big model late here (default: no)")
    parser.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY,
                        help=f"the baseline's checkpoint interval K (default {CHECKPOINT_EVERY})")
    parser.add_argument("--snapshot-interval", type=int, default=None,
                        help="ZOCheck's N (default: chosen by the startup profile)")
    parser.add_argument("--log-interval", type=int, default=10,
                        help="steps per controller segment, and between the failures of a point (default 10)")
    parser.add_argument("--steps", type=int, default=5000,
                        help="the comparison's run: every strategy fails at 80%% of it (default 5000; 0 skips it)")
    parser.add_argument("--comparison-model", default="tiny-opt", help="model of the comparison (default tiny-opt)")
    parser.add_argument("--intervals", type=int, nargs="+", default=list(PAPER_INTERVALS),
                        help="the checkpoint intervals K of the sync and async baselines (default 7 300 1000)")
    parser.add_argument("--modes", nargs="+", choices=["software", "host"], default=["software", "host"],
                        help="failure modes of the comparison (default both)")
    parser.add_argument("--large-hidden", type=int, default=512,
                        help="hidden size of the large comparison's OPT (default 512: ~14M parameters; 0 skips it)")
    parser.add_argument("--large-layers", type=int, default=4, help="layers of the large comparison's OPT (default 4)")
    parser.add_argument("--large-failure-step", type=int, default=40,
                        help="where the large comparison fails (default 40; log-only is extrapolated from there)")
    parser.add_argument("--large-run-steps", type=int, default=5000,
                        help="the nominal run log-only is extrapolated to, at 80%% (default 5000)")
    parser.add_argument("--storage", metavar="DIR", help="where both systems write (default: a temporary dir)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.set_defaults(func=run_cli)
