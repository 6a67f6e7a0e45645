"""Failures injected into a baseline strategy's trainer on Ray, and its recovery timed.

    result = run_with_failures(job, Strategy.parse("async:7"), fail_at=[100, 200])
    result["recoveries"][0]["restore_seconds"]

The trainer runs in a `baselines.StrategyActor`; a software failure makes its process exit
as it starts the failing step (records not yet sent are lost), a host failure kills it
with Ray; Ray restarts it and its constructor recovers from the strategy's checkpoints and
the durable log. The restart's account of itself (`RESTORE_PARTS`) and the driver's clock
give the breakdown the recovery benchmarks report.
"""

from __future__ import annotations

import os
import time

import ray

from zocheck_ray.bench.baselines import Strategy, StrategyActor
from zocheck_ray.config import JobConfig


def wait_new_incarnation(actor, old_pid: int | None, timeout: float = 300.0) -> dict:
    from zocheck_ray.actors.ray_actors import call_when_alive, wait_until_alive

    deadline = time.monotonic() + timeout
    while True:
        wait_until_alive(actor, timeout)  # as the controller does: a call sent during the restart waits on Ray's timer
        try:
            info = call_when_alive(lambda: actor.recovery.remote(), timeout=timeout)
        except ray.exceptions.RayActorError:  # the old process is still going down
            info = {"pid": old_pid}
        if info["pid"] != old_pid:
            return info
        if time.monotonic() > deadline:
            raise TimeoutError("the strategy's trainer did not come back after its failure")
        time.sleep(0.02)


def run_into_injected_failure(actor, fail: int, who: str) -> None:
    """Run `actor` (a trainer with `run(until_step, die_at_step)`) until it dies at step `fail`."""
    from ray.exceptions import RayActorError

    try:
        ray.get(actor.run.remote(fail + 1, fail))
    except RayActorError:
        return
    raise RuntimeError(f"{who} survived its injected failure at step {fail}")


RESTORE_PARTS = ("fetch_seconds", "install_seconds", "replay_seconds", "hash_seconds")
"""The restore, in order: getting the image (or checkpoint) and records, copying it into the model,
replaying the records, hashing the state (jobs that hash every step)."""


def restore_breakdown(info: dict) -> dict:
    """The `RESTORE_PARTS` of a restarted trainer's `recovery` dict (None where it has none)."""
    return {k: info.get(k) for k in RESTORE_PARTS}


def fail_and_recover(actor, fail: int, mode: str = "software") -> dict:
    """Kill the trainer of `actor` at step `fail` (software: the process exits as it starts step
    `fail`, losing unsent records; host: the process is killed once at `fail`, records flushed),
    let Ray restart it, and time its recovery until it is back at `fail`.

    Returns {"failed_at_step", "mode", "seconds" (driver: failure seen -> back at `fail`),
    "constructor_seconds", "restore_seconds" (checkpoint + log -> state, inside the constructor),
    "catch_up_seconds" (recomputing lost records), "process_seconds" (constructor + catch-up),
    "checkpoint_step", "replayed_records", "recomputed_steps",
    "load_seconds", "image_source", "state_hash" (at `fail`), "load_average"}.
    """
    if mode not in ("software", "host"):
        raise ValueError(f"mode must be software or host, got {mode!r}")
    old_pid = ray.get(actor.recovery.remote())["pid"]
    if mode == "software":
        run_into_injected_failure(actor, fail, "the trainer")
        started = time.perf_counter()
    else:
        ray.get(actor.run.remote(fail))
        started = time.perf_counter()
        ray.kill(actor, no_restart=False)
    info = wait_new_incarnation(actor, old_pid)
    caught = time.perf_counter()
    redo = ray.get(actor.run.remote(fail))
    catch_up = time.perf_counter() - caught
    seconds = time.perf_counter() - started
    step, digest = ray.get(actor.state_hash.remote())
    constructor = info["constructor_seconds"]
    return {"failed_at_step": fail, "mode": mode, "seconds": seconds, "constructor_seconds": constructor,
            "catch_up_seconds": catch_up if info["step"] < fail else 0.0,
            "process_seconds": constructor + (catch_up if info["step"] < fail else 0.0),
            "restore_seconds": info.get("restore_seconds"), "breakdown": restore_breakdown(info),
            "checkpoint_step": info.get("image_step", 0), "replayed_records": info["replayed_records"],
            "recovered_step": info["step"], "recomputed_steps": fail - info["step"],
            "load_seconds": info.get("load_seconds", 0.0), "recompute_seconds": redo["seconds"],
            "image_source": info["source"], "state_step": step, "state_hash": digest,
            "load_average": os.getloadavg()[0]}


def run_with_failures(job: JobConfig, strategy: Strategy, fail_at: list[int], url: str | None = None,
                      mode: str = "software", gpus: int = 0) -> dict:
    """Run `job` under a baseline `strategy` on the connected Ray cluster, failing at each step
    of `fail_at` (see `fail_and_recover`), then to `job.steps`.

    Returns {"strategy", "kind", "every", "url", "steps", "final_state_hash", "recoveries" (one
    `fail_and_recover` dict each), "trainer_seconds_per_step", "critical_path" (of the last
    incarnation, see the module docstring), "stage_ms_median", "stall_seconds"}.
    """
    if strategy.kind == "zocheck":
        raise ValueError("zocheck runs through controller.run, not run_with_failures")
    failures = sorted(set(fail_at))
    if any(not 0 < f < job.steps for f in failures):
        raise ValueError(f"fail_at steps must lie in (0, {job.steps}), got {failures}")
    url = url or job.run_url.rstrip("/") + "-" + strategy.slug
    actor = StrategyActor.options(num_cpus=1, num_gpus=gpus, max_restarts=len(failures) + job.max_restarts).remote(
        job.model_dump(mode="json"), url, strategy.name)
    recoveries = []
    try:
        ray.get(actor.recovery.remote())
        for fail in failures:
            recoveries.append(fail_and_recover(actor, fail, mode))
        last = ray.get(actor.run.remote(job.steps))
        path = ray.get(actor.critical_path.remote())
        ray.get(actor.close.remote())
        final_step, final_hash = ray.get(actor.state_hash.remote())
    finally:
        ray.kill(actor, no_restart=True)
    steps = max(path["steps"], 1)
    return {"strategy": strategy.name, "kind": strategy.kind, "every": strategy.every, "url": url,
            "steps": final_step, "final_state_hash": final_hash, "recoveries": recoveries,
            "trainer_seconds_per_step": path["train_seconds"] / steps, "critical_path": path,
            "stage_ms_median": path["checkpoint_ms_median"], "stall_seconds": path["stall_seconds"],
            "last_segment_seconds": last["seconds"]}
