"""`zocheck-ray bench data-parallel`: what data-parallel ZO costs and what it gains.

    zocheck-ray bench data-parallel --json benchmarks/results/data-parallel.json
    zocheck-ray bench data-parallel --steps 30 --gathers 300          # a quick look

Three measurements on a local Ray cluster, each against its baseline from the same run:

1. The collective: two ranks in a gloo process group over loopback all-gather four float64
   numbers (a rank's loss sums and counts), `--gathers` times; the median seconds per gather
   against the target of 1 ms, next to the trainer step it is part of.
2. Weak scaling: a k=2 run (one CPU thread per rank, `--batch` rows per rank, so twice the
   samples per step) against a k=1 run of `--batch` rows, one thread too: steps per second
   within 20%. Every process of the cluster the benchmark starts runs one thread.
3. Recovery: the k=2 run loses rank 1's process at `--fail-at`; the k=1 run loses its
   trainer at the same step. The k=2 recovery (survivors hand their records to the shadow,
   Ray restarts the rank, every rank rejoins, the group is re-formed) should be no slower.

Both runs are checked for exactness (the shadow and every rank end with the same state).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ray

from zocheck_ray.bench.common import machine, print_table, write_json

COLLECTIVE_TARGET_SECONDS = 1e-3
WEAK_SCALING_TOLERANCE = 0.20


@ray.remote(num_cpus=1)
class _GatherProbe:
    """One rank of a process group that only gathers (no model): the collective's own cost."""

    def __init__(self, rank: int, ranks: int):
        from zocheck_ray.actors.collective import LossGroup

        self.group = LossGroup(rank, ranks)

    def address(self) -> tuple[str, int]:
        from zocheck_ray.actors.collective import free_port

        return "127.0.0.1", free_port("127.0.0.1")  # both probes run on this node

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


def _run(trainers: int, batch_per_rank: int, steps: int, fail_at: int, model: str, storage: str) -> dict:
    from zocheck_ray.bench.common import BENCH_TASK
    from zocheck_ray.config import JobConfig
    from zocheck_ray.controller import run

    job = JobConfig(model=model, steps=steps, storage=storage, snapshot_interval=10, log_interval=10,
                    trainers=trainers, run_id=f"dp-bench-k{trainers}-{int(time.time())}",
                    task={**BENCH_TASK, "batch_size": batch_per_rank * trainers})
    summary = run(job, fail_at=[fail_at], fail_rank=trainers - 1, progress=None)
    (recovery,) = summary.recoveries
    hashes = set(summary.rank_state_hashes or [summary.final_state_hash])
    return {"trainers": trainers, "batch_per_rank": batch_per_rank, "samples_per_step": batch_per_rank * trainers,
            "seconds_per_step": summary.trainer_seconds_per_step,
            "steps_per_second": 1.0 / summary.trainer_seconds_per_step,
            "rank_seconds_per_step": summary.rank_seconds_per_step or [summary.trainer_seconds_per_step],
            "collective_seconds_per_step": summary.collective_seconds_per_step,
            "recovery_seconds": recovery.seconds, "recovered_rank": recovery.rank,
            "exact": hashes == {summary.shadow_state_hash}}


def data_parallel_benchmark(steps: int = 300, batch: int = 4, fail_at: int = 150, gathers: int = 1000,
                            model: str = "tiny-opt", json_path: str | None = None, say=print) -> dict:
    if not ray.is_initialized():
        # One thread per process in both runs (torch and the fused generator), as the comparison says.
        ray.init(address="local", num_cpus=4, namespace="zocheck", include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}})
    say(f"  collective: {gathers} all-gathers of 4 float64 per rank, 2 ranks, gloo ...")
    collective = collective_cost(gathers)
    runs = []
    with tempfile.TemporaryDirectory(prefix="zocheck-dp-bench-") as storage:
        for k in (1, 2):
            say(f"  k={k}: {steps} steps of {batch} rows per rank, rank {k - 1} lost at step {fail_at} ...")
            runs.append(_run(k, batch, steps, fail_at, model, storage))
    one, two = runs
    ratio = two["steps_per_second"] / one["steps_per_second"]
    targets = {
        "collective_under_1ms": collective["median_seconds"] <= COLLECTIVE_TARGET_SECONDS,
        "weak_scaling_within_20pct": ratio >= 1 - WEAK_SCALING_TOLERANCE,
        "rank_recovery_no_slower": two["recovery_seconds"] <= one["recovery_seconds"],
        "exact": one["exact"] and two["exact"],
    }
    targets["met"] = all(targets.values())
    doc = {"benchmark": "data-parallel", "machine": machine(), "model": model, "steps": steps,
           "collective": collective, "runs": runs, "weak_scaling_ratio": ratio,
           "recovery_ratio": two["recovery_seconds"] / one["recovery_seconds"], "targets": targets}
    print_table([{"what": "all-gather (2 ranks, gloo, loopback)", "value": collective["median_seconds"] * 1e3,
                  "unit": "ms median", "target": "<= 1 ms", "met": targets["collective_under_1ms"]},
                 {"what": "all-gather in the k=2 step (waits included)",
                  "value": (two["collective_seconds_per_step"] or 0) * 1e3, "unit": "ms per step",
                  "target": f"trainer step {two['seconds_per_step'] * 1e3:.1f} ms", "met": None},
                 {"what": "steps/s, k=2 over k=1 (2x samples)", "value": ratio, "unit": "ratio",
                  "target": ">= 0.80", "met": targets["weak_scaling_within_20pct"]},
                 {"what": "recovery, rank 1 of 2 / k=1 trainer", "value": doc["recovery_ratio"], "unit": "ratio",
                  "target": f"<= 1 ({two['recovery_seconds']:.2f} s / {one['recovery_seconds']:.2f} s)",
                  "met": targets["rank_recovery_no_slower"]},
                 {"what": "every rank == shadow, both runs", "value": None, "unit": "", "target": "exact",
                  "met": targets["exact"]}],
                [("what", "measurement", "s"), ("value", "value", ".3f"), ("unit", "unit", "s"),
                 ("target", "target", "s"), ("met", "met", "")])
    write_json(json_path, doc)
    return doc


def markdown(doc: dict) -> str:
    c, (one, two), t = doc["collective"], doc["runs"], doc["targets"]
    return "\n".join([
        "# Data parallel\n",
        f"Model {doc['model']}, {doc['steps']} steps, {one['batch_per_rank']} rows per rank.\n",
        "| measurement | value | target | met |", "|---|---|---|---|",
        f"| all-gather, 2 ranks, gloo over loopback (median) | {c['median_seconds'] * 1e3:.3f} ms | <= 1 ms | "
        f"{t['collective_under_1ms']} |",
        f"| all-gather within the k=2 step (waits included) | {(two['collective_seconds_per_step'] or 0) * 1e3:.3f} ms"
        f" of a {two['seconds_per_step'] * 1e3:.1f} ms step | - | - |",
        f"| steps/s k=2 / k=1 (twice the samples per step) | {doc['weak_scaling_ratio']:.2f} | >= 0.80 | "
        f"{t['weak_scaling_within_20pct']} |",
        f"| recovery of rank 1 of 2 / of the k=1 trainer | {two['recovery_seconds']:.2f} s / "
        f"{one['recovery_seconds']:.2f} s | <= 1 | {t['rank_recovery_no_slower']} |",
        f"| every rank == shadow | {t['exact']} | exact | {t['exact']} |", ""])


def run(args: argparse.Namespace) -> int:
    if not 0 < args.fail_at < args.steps:
        raise SystemExit(f"--fail-at must lie in (0, {args.steps})")
    doc = data_parallel_benchmark(args.steps, args.batch, args.fail_at, args.gathers, args.model, args.json)
    return 0 if doc["targets"]["exact"] else 1


def register(commands, bench) -> None:
    parser = bench.add_parser("data-parallel", help="collective cost, weak scaling and rank recovery of k=2 vs k=1",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="steps of each run (default 300; 60 steps of a few ms "
                        "are too few for a stable ratio)")
    parser.add_argument("--batch", type=int, default=4, help="rows per rank per step (default 4)")
    parser.add_argument("--fail-at", type=int, default=150, help="the step whose rank is lost (default 150)")
    parser.add_argument("--gathers", type=int, default=1000, help="timed all-gathers (default 1000)")
    parser.add_argument("--model", default="tiny-opt", help="the model of both runs (default tiny-opt)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.set_defaults(func=run)
