"""`python -m benchmarks data-parallel`: what data-parallel ZO costs and what it gains.

    python -m benchmarks data-parallel --json benchmarks/results/data-parallel.json
    python -m benchmarks data-parallel --steps 60 --fail-at 40 --gathers 300 --rounds 1   # a quick look

Three measurements on a local Ray cluster, each against its baseline from the same run:

1. The collective: two ranks in a gloo process group over loopback all-gather four float64
   numbers (a rank's loss sums and counts), `--gathers` times; the median seconds per gather
   against the target of 1 ms, next to the trainer step it is part of.
2. Weak scaling: a k=2 run (one CPU thread per rank, `--batch` rows per rank, so twice the
   samples per step) against a k=1 run of `--batch` rows, one thread too: steps per second
   within 20%. Every process of the cluster the benchmark starts runs one thread. Steps per
   second are the wall clock from the end of the warm-up to the last segment before the
   failure (segment boundaries included), so the restart and the restarted process's
   warm-up are not in them. `--rounds` pairs of runs go side by side, the order alternating;
   the ratio is the median of the pairs' ratios.
3. Recovery: the k=2 run loses rank 1's process at `--fail-at`; the k=1 run loses its
   trainer at the same step. The k=2 recovery (survivors hand their records to the shadow,
   Ray restarts the rank, every rank rejoins, the group is re-formed) should be no slower
   (medians over the rounds; each recovery's phases are in the JSON).

Every run is checked for exactness (the shadow and every rank end with the same state).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import ray

from benchmarks.common import machine, print_table, write_json

COLLECTIVE_TARGET_SECONDS = 1e-3
WEAK_SCALING_TOLERANCE = 0.20


@ray.remote(num_cpus=1)
class _GatherProbe:
    """One rank of a process group that only gathers (no model): the collective's own cost."""

    def __init__(self, rank: int, ranks: int):
        from zocheck_ray.runtime.parallel.collective import LossGroup

        self.group = LossGroup(rank, ranks)

    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.group.listen("127.0.0.1")  # both probes run on this node

    def join(self, address: str, port: int) -> float:
        return self.group.join(address, port)

    def gather(self, times: int) -> list[float]:
        seconds = []
        for i in range(times):
            began = time.perf_counter()
            self.group.gather((float(i), 3.0, float(i) + 0.5, 3.0))
            seconds.append(time.perf_counter() - began)
        self.group.leave()
        return seconds


def collective_cost(gathers: int, ranks: int = 2) -> dict:
    probes = [_GatherProbe.remote(r, ranks) for r in range(ranks)]
    address, port = ray.get(probes[0].address.remote())
    join_seconds = max(ray.get([p.join.remote(address, port) for p in probes]))
    per_rank = ray.get([p.gather.remote(gathers) for p in probes])
    for probe in probes:
        ray.kill(probe)
    samples = [s for seconds in per_rank for s in seconds[gathers // 10:]]  # the first tenth warms up
    return {"ranks": ranks, "gathers": gathers, "address": address, "join_seconds": join_seconds,
            "median_seconds": statistics.median(samples), "p90_seconds": sorted(samples)[int(0.9 * len(samples))]}


WARM_STEPS = 50
"""Steps before the throughput window opens (kernels load, caches and Ray's connections warm);
a third of the steps before the failure when that is fewer."""
MIN_FAIL_AT = 30
"""The window needs two segment ends (every 10 steps) before the failure."""


def _run(trainers: int, batch_per_rank: int, steps: int, fail_at: int, model: str, storage: str,
         snapshot_interval: int | None) -> dict:
    from benchmarks.common import BENCH_TASK
    from zocheck_ray.config import JobConfig
    from zocheck_ray.testing import run_with_faults

    job = JobConfig(model=model, steps=steps, storage=storage, shadow={"snapshot_interval": snapshot_interval},
                    log_interval=10, scaling={"trainers": trainers}, run_id=f"dp-bench-k{trainers}-{time.time_ns()}",
                    task={**BENCH_TASK, "batch_size": batch_per_rank * trainers})
    marks: list[tuple[int, float]] = []  # (step, wall clock) at the end of each segment before the failure

    def on_segment(last, metrics) -> None:
        # Strictly before the failure and rising: a segment after the recovery ends at or below a step already
        # marked (marks stand at every segment end before the failure), or at the failure's step or beyond.
        if min(WARM_STEPS, fail_at // 3) <= last.step < fail_at and (not marks or last.step > marks[-1][0]):
            marks.append((last.step, time.perf_counter()))

    summary = run_with_faults(job, fail_at=[fail_at], fail_rank=trainers - 1, progress=None, on_segment=on_segment)
    (recovery,) = summary.recoveries
    hashes = set(summary.rank_state_hashes or [summary.final_state_hash])
    (first, began), (last, ended) = marks[0], marks[-1]
    window = (ended - began) / (last - first)  # wall clock per step, segment boundaries included
    return {"trainers": trainers, "batch_per_rank": batch_per_rank, "samples_per_step": batch_per_rank * trainers,
            "window_steps": [first, last], "seconds_per_step": window, "steps_per_second": 1.0 / window,
            "run_seconds_per_step": summary.trainer_seconds_per_step,
            "rank_seconds_per_step": summary.rank_seconds_per_step or [summary.trainer_seconds_per_step],
            "collective_seconds_per_step": summary.collective_seconds_per_step,
            "recovery_seconds": recovery.seconds, "recovery_phases": recovery.phases,
            "recovered_rank": recovery.rank, "exact": hashes == {summary.shadow_state_hash}}


def round_order(i: int) -> tuple[int, int]:
    """The trainer counts of round `i` in the order they run: k=1 first in even rounds, k=2 first in odd
    ones, so a machine that slows or speeds up during the benchmark favours neither."""
    return (1, 2) if i % 2 == 0 else (2, 1)


def _median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def data_parallel_benchmark(steps: int = 400, batch: int = 16, fail_at: int = 300, gathers: int = 1000,
                            model: str = "tiny-opt", rounds: int = 3, json_path: str | None = None,
                            say=print, snapshot_interval: int | None = None) -> dict:
    if not MIN_FAIL_AT <= fail_at < steps:
        raise ValueError(f"fail_at={fail_at} must lie in [{MIN_FAIL_AT}, steps={steps}): steps per second are timed "
                         "between the warm-up and the failure")
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be at least 1")
    if not ray.is_initialized():
        # One thread per process in both runs (torch and the fused generator), as the comparison says.
        ray.init(address="local", num_cpus=4, namespace="zocheck", include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}})
    say(f"  collective: {gathers} all-gathers of 4 float64 per rank, 2 ranks, gloo ...")
    collective = collective_cost(gathers)
    runs = []
    with tempfile.TemporaryDirectory(prefix="zocheck-dp-bench-") as storage:
        for i in range(rounds):  # k=1 and k=2 side by side, the order alternating (a machine that drifts)
            for k in round_order(i):
                say(f"  round {i + 1}/{rounds}, k={k}: {steps} steps of {batch} rows per rank, rank {k - 1} lost "
                    f"at step {fail_at} ...")
                runs.append({"round": i, **_run(k, batch, steps, fail_at, model, storage, snapshot_interval)})
    one = [r for r in runs if r["trainers"] == 1]
    two = [r for r in runs if r["trainers"] == 2]
    ratios = [b["steps_per_second"] / a["steps_per_second"] for a, b in zip(one, two)]  # paired by round
    ratio = statistics.median(ratios)
    recovery_one, recovery_two = _median_of(one, "recovery_seconds"), _median_of(two, "recovery_seconds")
    step_two = _median_of(two, "seconds_per_step")
    collective_two = statistics.median(r["collective_seconds_per_step"] or 0.0 for r in two)
    targets = {
        "collective_under_1ms": collective["median_seconds"] <= COLLECTIVE_TARGET_SECONDS,
        "weak_scaling_within_20pct": ratio >= 1 - WEAK_SCALING_TOLERANCE,
        "rank_recovery_no_slower": recovery_two <= recovery_one,
        "exact": all(r["exact"] for r in runs),
    }
    targets["met"] = all(targets.values())
    doc = {"benchmark": "data-parallel", "machine": machine(), "model": model, "steps": steps, "rounds": rounds,
           "snapshot_interval": snapshot_interval or "cost model",
           "batch_per_rank": batch, "collective": collective, "runs": runs,
           "weak_scaling_ratios": ratios, "weak_scaling_ratio": ratio,
           "seconds_per_step": {"k1": _median_of(one, "seconds_per_step"), "k2": step_two},
           "collective_seconds_per_step_k2": collective_two,
           "recovery_seconds": {"k1": recovery_one, "k2": recovery_two},
           "recovery_ratio": recovery_two / recovery_one, "targets": targets}
    print_table([{"what": "all-gather (2 ranks, gloo, loopback)", "value": collective["median_seconds"] * 1e3,
                  "unit": "ms median", "target": "<= 1 ms", "met": targets["collective_under_1ms"]},
                 {"what": "all-gather in the k=2 step (waits included)", "value": collective_two * 1e3,
                  "unit": "ms per step", "target": f"trainer step {step_two * 1e3:.1f} ms", "met": None},
                 {"what": f"steps/s, k=2 over k=1 (2x samples), median of {rounds}", "value": ratio, "unit": "ratio",
                  "target": ">= 0.80", "met": targets["weak_scaling_within_20pct"]},
                 {"what": f"recovery, rank 1 of 2 / k=1 trainer, medians of {rounds}", "value": doc["recovery_ratio"],
                  "unit": "ratio", "target": f"<= 1 ({recovery_two:.2f} s / {recovery_one:.2f} s)",
                  "met": targets["rank_recovery_no_slower"]},
                 {"what": "every rank == shadow, every run", "value": None, "unit": "", "target": "exact",
                  "met": targets["exact"]}],
                [("what", "measurement", "s"), ("value", "value", ".3f"), ("unit", "unit", "s"),
                 ("target", "target", "s"), ("met", "met", "")])
    say("  per round: k=2/k=1 steps/s " + ", ".join(f"{r:.3f}" for r in ratios)
        + "; recovery k=1 " + ", ".join(f"{r['recovery_seconds']:.2f}" for r in one)
        + " s, k=2 " + ", ".join(f"{r['recovery_seconds']:.2f}" for r in two) + " s")
    write_json(json_path, doc)
    return doc


def markdown(doc: dict) -> str:
    c, t, rec = doc["collective"], doc["targets"], doc["recovery_seconds"]
    return "\n".join([
        "# Data parallel\n",
        f"Model {doc['model']}, {doc['steps']} steps, {doc['batch_per_rank']} rows per rank, {doc['rounds']} rounds "
        "of k=1 and k=2 side by side (medians).\n",
        "| measurement | value | target | met |", "|---|---|---|---|",
        f"| all-gather, 2 ranks, gloo over loopback (median) | {c['median_seconds'] * 1e3:.3f} ms | <= 1 ms | "
        f"{t['collective_under_1ms']} |",
        f"| all-gather within the k=2 step (waits included) | {doc['collective_seconds_per_step_k2'] * 1e3:.3f} ms"
        f" of a {doc['seconds_per_step']['k2'] * 1e3:.1f} ms step | - | - |",
        f"| steps/s k=2 / k=1 (twice the samples per step) | {doc['weak_scaling_ratio']:.2f} | >= 0.80 | "
        f"{t['weak_scaling_within_20pct']} |",
        f"| recovery of rank 1 of 2 / of the k=1 trainer | {rec['k2']:.2f} s / {rec['k1']:.2f} s | <= 1 | "
        f"{t['rank_recovery_no_slower']} |",
        f"| every rank == shadow | {t['exact']} | exact | {t['exact']} |", ""])


def run(args: argparse.Namespace) -> int:
    if not MIN_FAIL_AT <= args.fail_at < args.steps:
        raise SystemExit(f"--fail-at must lie in [{MIN_FAIL_AT}, {args.steps}): steps per second are timed between "
                         "the warm-up and the failure")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    doc = data_parallel_benchmark(args.steps, args.batch, args.fail_at, args.gathers, args.model, args.rounds,
                                 args.json, snapshot_interval=args.snapshot_interval)
    return 0 if doc["targets"]["exact"] else 1


# ------------------------------------------------------------ in `bench all`: options, tables, figures, verdicts

SUITE_OPTIONS = {"quick": {"steps": 60, "fail_at": 40, "gathers": 300, "rounds": 1}, "full": {}}
"""`data_parallel_benchmark` options of `bench all`'s run (`--quick` or not)."""


def run_in_suite(out: Path, quick: bool) -> dict:
    """`bench all`'s run; the JSON in `out`."""
    return data_parallel_benchmark(json_path=str(out / "data-parallel.json"),
                                   **SUITE_OPTIONS["quick" if quick else "full"])


def verdicts(doc: dict) -> list[str]:
    """The summary's lines for this benchmark's targets."""
    t, rec = doc["targets"], doc["recovery_seconds"]
    return [f"all-gather <= 1 ms: {t['collective_under_1ms']} ({doc['collective']['median_seconds'] * 1e3:.3f} ms); "
            f"k=2 steps/s within 20% of k=1: {t['weak_scaling_within_20pct']} ({doc['weak_scaling_ratio']:.2f}x); "
            f"rank recovery no slower than k=1: {t['rank_recovery_no_slower']} ({rec['k2']:.2f} s vs "
            f"{rec['k1']:.2f} s); exact: {t['exact']}"]


def register(bench) -> None:
    parser = bench.add_parser("data-parallel", help="collective cost, weak scaling and rank recovery of k=2 vs k=1",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="steps of each run (default 400)")
    parser.add_argument("--batch", type=int, default=16, help="rows per rank per step (default 16, MeZO's batch; "
                        "4 makes a step of a few ms, where the shadow's and Ray's fixed costs per step weigh most)")
    parser.add_argument("--fail-at", type=int, default=300, help="the step whose rank is lost (default 300); steps per "
                        f"second are timed from step {WARM_STEPS} (or a third of the way) to the last segment before it")
    parser.add_argument("--gathers", type=int, default=1000, help="timed all-gathers (default 1000)")
    parser.add_argument("--rounds", type=int, default=3, help="k=1 and k=2 runs side by side, the order alternating; "
                        "the ratios are medians (default 3)")
    parser.add_argument("--snapshot-interval", type=int, help="snapshot every N steps in both runs (default: what the "
                        "cost model chooses for each, as in a user's job)")
    parser.add_argument("--model", default="tiny-opt", help="the model of both runs (default tiny-opt)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.set_defaults(func=run)
