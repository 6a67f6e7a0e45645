"""Failures injected into a trainer on Ray, and its recovery timed: a baseline strategy's, or zocheck's.

    result = run_with_failures(job, Strategy.parse("async:7"), fail_at=[100, 200])
    result["recoveries"][0]["restore_seconds"]
    summary, recoveries = run_zocheck(job, failures=[100, 200])

The trainer runs in a `baselines.StrategyActor`; a software failure makes its process exit
as it starts the failing step (records not yet sent are lost), a host failure kills it
with Ray; Ray restarts it and its constructor recovers from the strategy's checkpoints and
the durable log. The restart's account of itself (`RESTORE_PARTS`) and the driver's clock
give the breakdown the recovery benchmarks report. `run_zocheck` runs `zocheck_ray.testing.run_with_faults` with
the same failures and adds the same breakdown to each of its recoveries.
"""

from __future__ import annotations

import os
import re
import time

import ray

from benchmarks.baselines import Strategy, StrategyActor
from zocheck_ray.actors.names import NAMESPACE, trainer_name
from zocheck_ray.config import JobConfig
from zocheck_ray.testing import run_with_faults


def wait_new_incarnation(actor, old_pid: int | None, timeout: float = 300.0) -> dict:
    """The `recovery` dict of `actor`'s process once it is not the one of `old_pid`: asked until Ray's restart
    of it answers (a call to the process that died fails, one during the restart raises ActorUnavailableError)."""
    from zocheck_ray.actors.link import call_when_alive

    deadline = time.monotonic() + timeout
    while True:
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
    restarts = len(failures) + job.failure.max_restarts
    actor = StrategyActor.options(num_cpus=1, num_gpus=gpus, max_restarts=restarts).remote(
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


_RECOVERED = re.compile(r"trainer lost at step (\d+).*recovered at step (\d+)")
_SEGMENT = re.compile(r"^\s*step\s+(\d+)\s")


def catch_up_seconds(events: list[tuple[float, str]]) -> dict[int, float]:
    """Failed step -> seconds from the controller's recovery line to its progress line of the
    segment that ended exactly at the failed step (the recomputation of the unsent records)."""
    out, pending = {}, None
    for t, line in events:
        if m := _RECOVERED.search(line):
            failed, recovered = int(m[1]), int(m[2])
            pending = None if recovered >= failed else (failed, t)
            if recovered >= failed:
                out[failed] = 0.0
        elif pending is not None and (m := _SEGMENT.match(line)):
            if int(m[1]) == pending[0]:
                out[pending[0]] = t - pending[1]
            pending = None
    return out


def run_zocheck(job: JobConfig, failures: list[int], fail_mode: str = "software"):
    """`run_with_faults` failing at `failures`; returns (RunSummary, one dict per recovery).

    Each dict is the controller's `Recovery` plus: lost_steps (unsent records the restarted
    trainer recomputes), catch_up_seconds (that recomputation, timed from the progress lines),
    catch_up_measured, seconds_to_failure_step (seconds + catch-up), constructor_seconds (the
    restarted trainer's own account), process_seconds (constructor + catch-up), load_average.
    """
    events: list[tuple[float, str]] = []
    loads: list[float] = []  # the machine's 1-minute load average at each line: other work slows restarts
    constructor_seconds: dict[int, float] = {}
    restore_seconds: dict[int, float] = {}
    breakdown: dict[int, dict] = {}

    def on_progress(line: str) -> None:
        if m := _RECOVERED.search(line):  # the restarted trainer's own account of its constructor
            trainer = ray.get_actor(trainer_name(job.run_id), namespace=NAMESPACE)
            info = ray.get(trainer.recovery.remote()).model_dump()
            constructor_seconds[int(m[1])] = info.get("seconds")
            restore_seconds[int(m[1])] = info.get("restore_seconds")
            breakdown[int(m[1])] = restore_breakdown(info)
        events.append((time.perf_counter(), line))  # after that call: it is not part of the catch-up
        loads.append(os.getloadavg()[0])

    summary = run_with_faults(job, fail_at=failures, fail_mode=fail_mode, progress=on_progress)
    step_seconds = summary.trainer_seconds_per_step
    measured = catch_up_seconds(events)
    load_at = {int(m[1]): load for (_, line), load in zip(events, loads) if (m := _RECOVERED.search(line))}
    zocheck = []
    for r in summary.recoveries:
        lost = r.failed_at_step - r.recovered_step
        catch_up = 0.0 if lost <= 0 else measured.get(r.failed_at_step, lost * step_seconds)
        constructor = constructor_seconds.get(r.failed_at_step)
        zocheck.append({**r.model_dump(), "lost_steps": lost, "catch_up_seconds": catch_up,
                        "catch_up_measured": lost <= 0 or r.failed_at_step in measured,
                        "seconds_to_failure_step": r.seconds + catch_up, "constructor_seconds": constructor,
                        "process_seconds": None if constructor is None else constructor + catch_up,
                        "restore_seconds": restore_seconds.get(r.failed_at_step),
                        "breakdown": breakdown.get(r.failed_at_step),
                        "load_average": load_at.get(r.failed_at_step)})
    return summary, zocheck
