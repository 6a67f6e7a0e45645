"""`python -m benchmarks elastic`: what a lost rank costs the others in an elastic group, and what k buys.

    python -m benchmarks elastic --json benchmarks/results/elastic.json
    python -m benchmarks elastic --steps 40 --fail-at 20 --rounds 1   # a quick look

Two measurements on a local Ray instance, with one shard layout (`--shards` S) throughout:

1. Steps per second at k = 1, 2 and 3 ranks: the wall clock per step between segment ends after a
   warm-up. Every run ends with the same state hash (the answer depends on S, not on k).
2. A rank lost mid-step (rank 1 of 2, its process exits before its exchange at +eps of step
   `--fail-at`), `--rounds` times, medians: the survivor's stall in an elastic run (`scaling.trainers:
   {min: 1, max: 2}`: from the failed exchange to its repeat, detection included) with the survivor's
   report, with it where Ray does not restart the lost process (`failure.max_restarts: 0`: no new worker
   process starts beside the survivor), and with Ray's report of the lost call alone (the controller's
   `peer_lost` calls left out, as before the report), against the recovery of the same loss in a fixed
   k=2 run (every rank stops, Ray restarts the lost rank, every rank rejoins). The target: a stall under
   one k=2 step plus detection.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import nullcontext
from unittest import mock

import ray

from benchmarks.common import machine, print_table, write_json

WARM_STEPS = 10
"""Steps before the throughput window opens (kernels load, caches and Ray's connections warm)."""


def _job(trainers, shards: int, rows_per_shard: int, steps: int, model: str, storage: str, tag: str,
         restarts: int = 10):
    from benchmarks.common import BENCH_TASK
    from zocheck_ray.config import JobConfig

    return JobConfig(model=model, steps=steps, storage=storage, shadow={"snapshot_interval": 10}, log_interval=5,
                     failure={"max_restarts": restarts},
                     scaling={"trainers": trainers}, run_id=f"elastic-bench-{tag}-{time.time_ns()}",
                     task={**BENCH_TASK, "batch_size": shards * rows_per_shard, "shards": shards})


def _throughput(job) -> dict:
    from zocheck_ray.testing import run_with_faults

    marks: list[tuple[int, float]] = []

    def on_segment(last, metrics) -> None:
        if last.step >= WARM_STEPS:
            marks.append((last.step, time.perf_counter()))

    summary = run_with_faults(job, progress=None, on_segment=on_segment)
    (first, began), (last, ended) = marks[0], marks[-1]
    seconds = (ended - began) / (last - first)
    return {"trainers": job.scaling.trainers, "seconds_per_step": seconds, "steps_per_second": 1.0 / seconds,
            "collective_seconds_per_step": summary.collective_seconds_per_step,
            "final_state_hash": summary.final_state_hash,
            "exact": set(summary.rank_state_hashes or [summary.final_state_hash]) == {summary.shadow_state_hash}}


LOSSES = {"report": "elastic, the survivor's report", "unrestarted": "the same, the lost process not restarted",
          "ray": "elastic, Ray's report alone", "fixed": "fixed, whole-group recovery"}
"""The three ways a loss is met, side by side in each round."""


def _loss(job, fail_at: int, detection: str, markers: str) -> dict:
    from zocheck_ray.control.elastic_group import ElasticGroup
    from zocheck_ray.testing import run_with_faults
    from zocheck_ray.runtime.injection import FaultInjection

    if detection != "fixed":
        faults = FaultInjection(die_at_exchange={1: [(fail_at, 0)]}, marker_dir=markers)
        with mock.patch.object(ElasticGroup, "_watch", lambda self: {}) if detection == "ray" else nullcontext():
            summary = run_with_faults(job, faults=faults, progress=None)
        (change,) = [c for c in summary.group_changes if c.kind == "shrink"]
        stall, plan_wait = change.stall_seconds, change.plan_wait_seconds
    else:
        summary = run_with_faults(job, fail_at=[fail_at], fail_rank=1, progress=None)
        (recovery,) = summary.recoveries
        stall, plan_wait = recovery.seconds, None
    return {"detection": detection, "stall_seconds": stall, "plan_wait_seconds": plan_wait,
            "final_state_hash": summary.final_state_hash,
            "step_seconds": summary.trainer_seconds_per_step, "ranks_at_end": len(summary.rank_state_hashes),
            "exact": set(summary.rank_state_hashes) == {summary.shadow_state_hash}}


def _medians(losses: list[dict], detection: str) -> dict:
    runs = [r for r in losses if r["detection"] == detection]
    stalls = [r["stall_seconds"] for r in runs]
    doc = {"stall_seconds": statistics.median(stalls), "stall_range": [min(stalls), max(stalls)]}
    if detection != "fixed":
        doc["plan_wait_seconds"] = statistics.median(r["plan_wait_seconds"] for r in runs)
        doc["after_plan_seconds"] = statistics.median(r["stall_seconds"] - r["plan_wait_seconds"] for r in runs)
    return doc


def elastic_benchmark(steps: int = 60, fail_at: int = 30, shards: int = 6, rows_per_shard: int = 2,
                      model: str = "tiny-opt", json_path: str | None = None, rounds: int = 3, say=print) -> dict:
    if not WARM_STEPS < fail_at < steps:
        raise ValueError(f"fail_at={fail_at} must lie in ({WARM_STEPS}, steps={steps})")
    if shards < 3:
        raise ValueError(f"shards={shards} must be at least 3: k = 1, 2, 3 share them")
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be at least 1")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, namespace="zocheck", include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}})
    with tempfile.TemporaryDirectory(prefix="zocheck-elastic-bench-") as storage:
        throughput = []
        for k in (1, 2, 3):
            say(f"  k={k}: {steps} steps, {shards} shards of {rows_per_shard} rows ...")
            throughput.append(_throughput(_job(k, shards, rows_per_shard, steps, model, storage, f"k{k}")))
        losses = []
        for i in range(rounds):
            for detection in LOSSES:
                say(f"  round {i}, {LOSSES[detection]}: rank 1 of 2 lost at step {fail_at} ...")
                trainers = 2 if detection == "fixed" else {"min": 1, "max": 2}
                job = _job(trainers, shards, rows_per_shard, steps, model, storage, f"{detection}{i}",
                           restarts=0 if detection == "unrestarted" else 10)
                losses.append({"round": i, **_loss(job, fail_at, detection, tempfile.mkdtemp(dir=storage))})
    return _report(throughput, losses, dict(model=model, steps=steps, shards=shards, rows_per_shard=rows_per_shard,
                                            fail_at=fail_at, rounds=rounds), json_path)


def _report(throughput: list[dict], losses: list[dict], settings: dict, json_path: str | None) -> dict:
    medians = {detection: _medians(losses, detection) for detection in LOSSES}
    report, ray_only, fixed = medians["report"], medians["ray"], medians["fixed"]
    step_k2 = throughput[1]["seconds_per_step"]
    finals = {r["final_state_hash"] for r in throughput + losses}
    targets = {"stall_below_whole_group_recovery": report["stall_seconds"] < fixed["stall_seconds"],
               "stall_after_the_plan_under_a_step": report["after_plan_seconds"] < step_k2,
               "unrestarted_after_the_plan_under_a_step": medians["unrestarted"]["after_plan_seconds"] < step_k2,
               "report_faster_than_ray": report["stall_seconds"] < ray_only["stall_seconds"],
               "same_state_whatever_k": len(finals) == 1, "exact": all(r["exact"] for r in throughput + losses)}
    doc = {"benchmark": "elastic", "machine": machine(), **settings, "throughput": throughput, "losses": losses,
           "medians": medians, "stall_ratio": report["stall_seconds"] / fixed["stall_seconds"], "targets": targets}
    rows = [{"what": f"steps/s, k={r['trainers']}, S={settings['shards']}", "value": r["steps_per_second"],
             "unit": "steps/s", "note": f"{r['seconds_per_step'] * 1e3:.1f} ms a step"} for r in throughput]
    for detection, m in medians.items():
        low, high = m["stall_range"]
        rows.append({"what": f"stall, {LOSSES[detection]}", "value": m["stall_seconds"], "unit": "s",
                     "note": f"median of {settings['rounds']} ({low:.3f}-{high:.3f})"})
        if detection != "fixed":
            rows.append({"what": "  of it the wait for the plan", "value": m["plan_wait_seconds"], "unit": "s",
                         "note": f"after it {m['after_plan_seconds'] * 1e3:.1f} ms, a k=2 step {step_k2 * 1e3:.1f} ms"})
    rows.append({"what": "one final state for every k and every loss", "value": None, "unit": "",
                 "note": str(targets["same_state_whatever_k"] and targets["exact"])})
    print_table(rows, [("what", "measurement", "s"), ("value", "value", ".3f"), ("unit", "unit", "s"),
                       ("note", "note", "s")])
    write_json(json_path, doc)
    return doc


def run(args: argparse.Namespace) -> int:
    doc = elastic_benchmark(args.steps, args.fail_at, args.shards, args.rows_per_shard, args.model, args.json,
                            args.rounds)
    return 0 if doc["targets"]["exact"] and doc["targets"]["same_state_whatever_k"] else 1


def register(bench) -> None:
    parser = bench.add_parser("elastic", help="elastic data parallel: a lost rank's stall, steps/s at k = 1, 2, 3",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="steps of each run (default 60)")
    parser.add_argument("--fail-at", type=int, default=30, help="the step whose rank 1 is lost (default 30)")
    parser.add_argument("--shards", type=int, default=6, help="S, the batch's shards in every run (default 6)")
    parser.add_argument("--rows-per-shard", type=int, default=2, help="rows of each shard (default 2)")
    parser.add_argument("--model", default="tiny-opt", help="the model of every run (default tiny-opt)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three losses, medians (default 3)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.set_defaults(func=run)
