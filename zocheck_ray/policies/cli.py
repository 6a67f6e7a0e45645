"""`zocheck-ray plan` and `zocheck-ray simulate`: the cost model before buying hardware.

    zocheck-ray plan --gpu-step 8.65 --replay-step 6.59 --snapshot-cost 4 --persist-time 20 \\
        --mtbf-hours 24 --json plan.json
    zocheck-ray simulate --gpu-step 2.85 --replay-step 3.68 --snapshot-cost 2 --persist-time 10 \\
        --mtbf-range 1 1000 --points 7 --plot waste.png --json waste.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from zocheck_ray.policies.cost_model import FailureModel, PolicyInputError, Timings
from zocheck_ray.policies.planner import Plan, plan
from zocheck_ray.policies.simulator import simulate_waste
from zocheck_ray.policies.waste import STRATEGIES, configure, expected_waste

# Timings field -> (flag, help); the first four are required.
TIMING_FLAGS = {
    "gpu_step_seconds": ("--gpu-step", "T_gpu: trainer step on the accelerator, seconds"),
    "replay_step_seconds": ("--replay-step", "T_rep: shadow CPU replay of one step, seconds"),
    "snapshot_cost_seconds": ("--snapshot-cost", "C_snap: in-memory snapshot copy, seconds"),
    "persist_seconds": ("--persist-time", "T_per: writing one snapshot to storage, seconds"),
    "restart_seconds": ("--restart", "restart or rescheduling after a failure, seconds (default 0)"),
    "load_seconds": ("--load", "copying an image into the trainer, seconds (default: --snapshot-cost)"),
    "storage_read_seconds": ("--storage-read", "reading a durable image, seconds (default: --persist-time)"),
    "recovery_replay_step_seconds": ("--recovery-replay-step",
                                     "replaying one record on the recovering trainer (default: --replay-step)"),
    "log_step_seconds": ("--log-step", "critical-path cost of logging one step record, seconds (default 0)"),
    "state_copy_seconds": ("--state-copy",
                           "blocking device-to-host state copy, for async staging and resyncs "
                           "(default: --snapshot-cost)"),
    "checkpoint_save_seconds": ("--checkpoint-save",
                                "writing one full checkpoint, seconds (default: --persist-time)"),
}
OTHER_FLAGS = {
    "mtbf_hours": "--mtbf-hours", "mtbf_range": "--mtbf-range", "run_hours": "--run-hours",
    "failure_kind": "--failure-kind", "lag_bound_steps": "--lag-bound",
    "checkpoint_interval_steps": "--checkpoint-interval", "trials": "--trials", "confidence": "--confidence",
}


def _flag(field: str) -> str:
    if field in TIMING_FLAGS:
        return TIMING_FLAGS[field][0]
    return OTHER_FLAGS.get(field, field)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    for i, (field, (flag, help_text)) in enumerate(TIMING_FLAGS.items()):
        parser.add_argument(flag, dest=field, type=float, required=i < 4, metavar="S", help=help_text)
    parser.add_argument("--failure-kind", choices=("software", "host"), default="software",
                        help="which failures to plan for (default software)")
    parser.add_argument("--run-hours", type=float, metavar="H",
                        help="training hours of the run; log-only replays since its start (default: one MTBF)")
    parser.add_argument("--lag-bound", dest="lag_bound_steps", type=float, metavar="STEPS",
                        help="resync when the shadow is this many steps behind (default: the optimum)")
    parser.add_argument("--checkpoint-interval", dest="checkpoint_interval_steps", type=int, metavar="K",
                        help="steps between full checkpoints for the baselines (default: Young-Daly)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the result as JSON")


def _timings(args: argparse.Namespace) -> Timings:
    return Timings(**{field: getattr(args, field) for field in TIMING_FLAGS if getattr(args, field) is not None})


def _failures(args: argparse.Namespace, mtbf_hours: float) -> FailureModel:
    return FailureModel(mtbf_hours=mtbf_hours, failure_kind=args.failure_kind, run_hours=args.run_hours)


def _report_error(command: str, error: Exception) -> int:
    if isinstance(error, ValidationError):
        for item in error.errors():
            field = str(item["loc"][0]) if item["loc"] else ""
            message = item["msg"].removeprefix("Value error, ")
            print(f"zocheck-ray {command}: error: {_flag(field)}: {message}", file=sys.stderr)
    else:
        field = getattr(error, "field", "")
        message = str(error).removeprefix(f"{field}: ")
        print(f"zocheck-ray {command}: error: {_flag(field)}: {message}", file=sys.stderr)
    return 2


def _format_plan(result: Plan) -> str:
    def num(value, unit=""):
        return "-" if value is None else f"{value:.4g}{unit}"

    rows = [
        ("pacing bound (N >=)", num(result.pacing_bound) if result.pacing_bound is not None else "none (lag)"),
        ("persistence bound (N >=)", num(result.persistence_bound)),
        ("regime", result.regime),
        ("snapshot interval N", str(result.snapshot_interval)),
        ("expected replay distance", num(result.expected_replay_distance_steps, " steps")),
        ("expected recovery", num(result.expected_recovery_seconds, " s")),
        ("lag growth", num(result.lag_growth_steps_per_second, " steps/s")),
        ("resync lag bound", num(result.lag_bound_steps, " steps")),
        ("resync interval", num(result.resync_interval_seconds, " s")),
    ]
    lines = [f"{name:<28}{value}" for name, value in rows]
    if result.waste:
        header = f"{'strategy':<18}{'N or K':>8}{'overhead s':>12}{'recovery s':>12}{'waste s':>12}{'wasted':>9}"
        lines += ["", header]
        for strategy, estimate in result.waste.items():
            config = estimate.config
            interval = config.snapshot_interval or config.checkpoint_interval_steps
            lines.append(f"{strategy:<18}{'-' if interval is None else interval:>8}"
                         f"{estimate.overhead_seconds:>12.4g}{estimate.recovery_seconds:>12.4g}"
                         f"{estimate.waste_seconds:>12.4g}{100 * estimate.waste_fraction:>8.3g}%")
        lines.append(f"(per failure window, MTBF {result.failures.mtbf_hours:g} h, "
                     f"{result.failures.failure_kind} failures)")
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)


def output_file_error(flag: str, path: str) -> str | None:
    """Why `path` cannot take a command's output file, or None; checked before the work, so no result is lost."""
    target = os.path.abspath(os.path.expanduser(path))
    parent = os.path.dirname(target)
    if os.path.isdir(target):
        return f"{flag} {path} is a directory; name a file"
    if not os.path.isdir(parent):
        return f"{flag} {path}: {parent} is not an existing directory; create it or name another file"
    if not os.access(parent, os.W_OK) or (os.path.exists(target) and not os.access(target, os.W_OK)):
        return f"{flag} {path} is not writable here; name a file you may write"
    return None


def plan_command(args: argparse.Namespace) -> int:
    """`zocheck-ray plan`: bounds, regime, N and the expected waste of each strategy."""
    if args.json is not None and (problem := output_file_error("--json", str(args.json))) is not None:
        print(f"zocheck-ray plan: error: {problem}", file=sys.stderr)
        return 2
    try:
        timings = _timings(args)
        failures = None if args.mtbf_hours is None else _failures(args, args.mtbf_hours)
        result = plan(timings, failures, lag_bound_steps=args.lag_bound_steps,
                      checkpoint_interval_steps=args.checkpoint_interval_steps)
    except (ValidationError, PolicyInputError) as error:
        return _report_error("plan", error)
    print(_format_plan(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result.model_dump(mode="json"), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _mtbf_points(args: argparse.Namespace) -> list[float]:
    if args.mtbf_hours:
        return list(args.mtbf_hours)
    low, high = args.mtbf_range
    if not (0 < low < high) or args.points < 2:
        raise PolicyInputError("mtbf_range", f"--mtbf-range needs 0 < LO < HI and --points >= 2, "
                                             f"got {low!r} {high!r} with {args.points!r} points")
    return [float(v) for v in np.geomspace(low, high, args.points)]


def simulate_command(args: argparse.Namespace) -> int:
    """`zocheck-ray simulate`: Monte-Carlo wasted time against MTBF for each strategy."""
    rows = []
    if args.json is not None and (problem := output_file_error("--json", str(args.json))) is not None:
        print(f"zocheck-ray simulate: error: {problem}", file=sys.stderr)
        return 2
    if args.plot is not None:  # asked for a figure: say at once if it cannot be drawn, not after the simulation
        from zocheck_ray.plotting import missing_reason

        reason = missing_reason()
        if reason is not None:
            print(f"zocheck-ray simulate: error: --plot {args.plot}: {reason}; "
                  "or leave out --plot for the table and --json", file=sys.stderr)
            return 2
    try:
        timings = _timings(args)
        for mtbf in _mtbf_points(args):
            failures = _failures(args, mtbf)
            for strategy in args.strategies:
                config = configure(timings, failures, strategy, lag_bound_steps=args.lag_bound_steps,
                                   checkpoint_interval_steps=args.checkpoint_interval_steps)
                closed = expected_waste(timings, failures, config)
                sim = simulate_waste(timings, failures, config, trials=args.trials, seed=args.seed,
                                     confidence=args.confidence)
                rows.append({"mtbf_hours": mtbf, "strategy": strategy, "config": config.model_dump(),
                             "closed_form_seconds": closed.waste_seconds,
                             "closed_form_fraction": closed.waste_fraction,
                             "simulated": sim.model_dump(mode="json")})
    except (ValidationError, PolicyInputError) as error:
        return _report_error("simulate", error)
    print(f"{'MTBF h':>9}  {'strategy':<18}{'simulated waste/window s':>28}{'closed form s':>15}{'wasted':>9}")
    for row in rows:
        sim = row["simulated"]
        half = (sim["ci_high_seconds"] - sim["ci_low_seconds"]) / 2
        print(f"{row['mtbf_hours']:>9.4g}  {row['strategy']:<18}{sim['mean_seconds']:>18.5g} +- {half:<7.2g}"
              f"{row['closed_form_seconds']:>15.5g}{100 * sim['waste_fraction']:>8.3g}%")
    print(f"({args.trials} failure windows per point, seed {args.seed}, "
          f"{100 * args.confidence:g}% intervals, {args.failure_kind} failures)")
    if args.json is not None:
        payload = {"timings": timings.model_dump(), "failure_kind": args.failure_kind, "rows": rows}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot is not None:
        plot_waste(rows, args.plot, args.failure_kind)
        print(f"wrote {args.plot}")
    return 0


def plot_waste(rows: list[dict], path: Path, failure_kind: str) -> None:
    """Wasted time per failure window and share of wall-clock wasted, against MTBF (needs matplotlib)."""
    from zocheck_ray.plotting import require_matplotlib

    require_matplotlib(f"plot {path}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    per_window, share = figure.subplots(1, 2)
    for strategy in dict.fromkeys(row["strategy"] for row in rows):
        mine = [row for row in rows if row["strategy"] == strategy]
        mtbf = [row["mtbf_hours"] for row in mine]
        mean = np.array([row["simulated"]["mean_seconds"] for row in mine]) / 3600
        low = np.array([row["simulated"]["ci_low_seconds"] for row in mine]) / 3600
        high = np.array([row["simulated"]["ci_high_seconds"] for row in mine]) / 3600
        line, = per_window.plot(mtbf, mean, marker="o", label=strategy)
        per_window.fill_between(mtbf, low, high, color=line.get_color(), alpha=0.25)
        per_window.plot(mtbf, [row["closed_form_seconds"] / 3600 for row in mine], ls=":", color=line.get_color())
        share.plot(mtbf, [100 * row["simulated"]["waste_fraction"] for row in mine], marker="o", label=strategy)
    per_window.set(xscale="log", yscale="log", xlabel="MTBF (hours)", ylabel="wasted hours per failure window",
                   title=f"Wasted time ({failure_kind} failures; dotted: closed form)")
    share.set(xscale="log", yscale="log", xlabel="MTBF (hours)", ylabel="wall-clock wasted (%)",
              title="Share of a long run wasted")
    for axes in (per_window, share):
        axes.grid(True, which="both", alpha=0.3)
    share.legend()
    figure.savefig(path, dpi=120)


def register(subparsers) -> None:
    """Add `plan` and `simulate` to the `zocheck-ray` command line."""
    plan_parser = subparsers.add_parser(
        "plan", help="cost model: pacing and persistence bounds, regime, snapshot interval, expected waste")
    _add_model_args(plan_parser)
    plan_parser.add_argument("--mtbf-hours", type=float, metavar="H",
                             help="mean time between failures; needed for the waste and the lag-regime N")
    plan_parser.set_defaults(func=plan_command)

    sim_parser = subparsers.add_parser(
        "simulate", help="Monte-Carlo wasted time against MTBF for ZOCheck and the baselines")
    _add_model_args(sim_parser)
    points = sim_parser.add_mutually_exclusive_group()
    points.add_argument("--mtbf-hours", type=float, nargs="+", metavar="H", help="MTBF values to simulate")
    points.add_argument("--mtbf-range", type=float, nargs=2, default=(1.0, 1000.0), metavar=("LO", "HI"),
                        help="log-spaced MTBF range in hours (default 1 1000)")
    sim_parser.add_argument("--points", type=int, default=7, help="MTBF values in --mtbf-range (default 7)")
    sim_parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES),
                            help="strategies to compare (default all)")
    sim_parser.add_argument("--trials", type=int, default=20_000, help="failure windows per point (default 20000)")
    sim_parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    sim_parser.add_argument("--confidence", type=float, default=0.95, help="interval confidence (default 0.95)")
    sim_parser.add_argument("--plot", type=Path, metavar="FILE.png", help="draw wasted time against MTBF (needs matplotlib: pip install 'zocheck-ray[bench]')")
    sim_parser.set_defaults(func=simulate_command)
