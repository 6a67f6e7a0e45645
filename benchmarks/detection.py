"""`python -m benchmarks detection`: how soon the controller knows that a trainer rank's process died.

    python -m benchmarks detection --json benchmarks/results/detection.json
    python -m benchmarks detection --modes state-api calls --repeats 3

A tiny actor stands in for a rank (how a death is seen does not depend on the model): the run's
`TrainerGroup` sends it a segment, the actor's `run` waits in it, and this process kills the actor's
process (SIGKILL) once it is inside. Detection is the time from the kill to the group's `Failure`.
Each mode runs on a local Ray instance of its own:

- `state-api`: the cluster runs its dashboard; the group asks Ray's state API while the segment runs;
- `calls`: the cluster runs without its dashboard (no state API); the group learns of the death when
  the segment's call fails, after Ray's wait for the death's details;
- `no-restart`: an actor with `max_restarts=0`, as Ray Train v2 runs its workers (it re-creates a lost
  one itself): the in-flight call fails as the process dies, with no restart for Ray to wait on.

`calls`, what Ray tells a caller without being asked, is the baseline, measured in the same run. A
quiet segment of `--quiet-seconds` (nobody dies) gives the CPU spent watching the ranks: the driver's,
and that of the Ray processes it started (the GCS, and the dashboard that serves the state API).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import threading
import time
import uuid

from benchmarks.common import machine, print_table, write_json

MODES = ("state-api", "calls", "no-restart")
BASELINE = "calls"
KILL_CEILING_SECONDS = 120.0
"""A ceiling for a detection that never comes (a regression), not a timing."""


def _rank_class():
    import ray

    @ray.remote
    class Rank:
        """A rank whose segment waits until its process is killed (or `quiet` seconds, for a quiet segment)."""

        def __init__(self, inside: str, quiet: float | None = None):
            self.inside, self.quiet = inside, quiet

        def pid(self) -> int:
            return os.getpid()

        def run(self, target: int, durable_next: int | None = None):
            open(self.inside, "w").close()
            time.sleep(self.quiet if self.quiet is not None else 3600)

    return Rank


def _wait_for(path: str, timeout: float = KILL_CEILING_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the rank never began its segment ({path})")
        time.sleep(0.005)


def detect_with_group(root: str) -> float:
    """One kill of a rank inside a segment that its `TrainerGroup` runs; seconds until the group's `Failure`."""
    import ray

    from zocheck_ray.actors.names import NAMESPACE, trainer_name
    from zocheck_ray.config import JobConfig
    from zocheck_ray.control.group import TrainerGroup

    job = JobConfig(storage=root, run_id=f"detect-{uuid.uuid4().hex[:8]}")
    inside = os.path.join(root, job.run_id)
    actor = _rank_class().options(name=trainer_name(job.run_id, 0), namespace=NAMESPACE, num_cpus=0,
                                  max_restarts=1).remote(inside)
    pid = ray.get(actor.pid.remote())
    group = TrainerGroup(job, [actor])
    group._note_restarts()  # as `start` does once its ranks are up
    seen: dict = {}

    def segment():
        result = group.run(10, 0)
        seen.update(at=time.perf_counter(), result=result)

    runner = threading.Thread(target=segment, daemon=True)
    runner.start()
    _wait_for(inside)
    time.sleep(0.2)  # the group is well inside its wait
    killed = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    runner.join(timeout=KILL_CEILING_SECONDS)
    if "result" not in seen:
        raise TimeoutError(f"the group did not see its rank die within {KILL_CEILING_SECONDS:g} s")
    _, failure = seen["result"]
    if failure is None or tuple(failure.ranks) != (0,):
        raise RuntimeError(f"the group reported {failure!r}, not the loss of rank 0")
    ray.kill(actor, no_restart=True)
    return seen["at"] - killed


def detect_without_restart(root: str) -> float:
    """One kill of a `max_restarts=0` actor inside a call; seconds until the call raises."""
    import ray

    inside = os.path.join(root, uuid.uuid4().hex)
    actor = _rank_class().options(num_cpus=0, max_restarts=0).remote(inside)
    pid = ray.get(actor.pid.remote())
    call = actor.run.remote(10)
    _wait_for(inside)
    time.sleep(0.2)
    killed = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    try:
        ray.get(call, timeout=KILL_CEILING_SECONDS)
    except ray.exceptions.RayActorError:
        return time.perf_counter() - killed
    raise RuntimeError("the call to a killed actor returned")


def quiet_cpu_share(root: str, seconds: float) -> tuple[float, float]:
    """The CPU seconds per second of this driver, and of the Ray processes it started (GCS, raylet, dashboard,
    ...), while its group runs a segment in which nobody dies."""
    import ray

    from zocheck_ray.actors.names import NAMESPACE, trainer_name
    from zocheck_ray.config import JobConfig
    from zocheck_ray.control.group import TrainerGroup

    job = JobConfig(storage=root, run_id=f"quiet-{uuid.uuid4().hex[:8]}")
    actor = _rank_class().options(name=trainer_name(job.run_id, 0), namespace=NAMESPACE, num_cpus=0).remote(
        os.path.join(root, job.run_id), seconds)
    ray.get(actor.pid.remote())
    group = TrainerGroup(job, [actor])
    group._note_restarts()
    cpu, started, wall = time.process_time(), _started_cpu(), time.perf_counter()
    group._gather({0: actor.run.remote(10)})  # the segment's wait, without a trainer's progress to add up
    wall = time.perf_counter() - wall
    shares = ((time.process_time() - cpu) / wall, (_started_cpu() - started) / wall)
    ray.kill(actor, no_restart=True)
    return shares


def _started_cpu() -> float:
    """The CPU seconds of the processes this one started (a local Ray instance's), so far."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:  # gone meanwhile
            continue
        total += times.user + times.system
    return total


def measure(mode: str, repeats: int, quiet_seconds: float) -> dict:
    """`repeats` detections in `mode`, on a local Ray instance of its own; the mode's row of the table."""
    import ray

    from zocheck_ray.actors.names import NAMESPACE

    ray.init(address="local", num_cpus=2, namespace=NAMESPACE, include_dashboard=mode == "state-api",
             log_to_driver=False)
    try:
        path = _group_path()
        with tempfile.TemporaryDirectory(prefix="zocheck-detection-") as root:
            if mode == "no-restart":
                seconds = [detect_without_restart(root) for _ in range(repeats)]
                cpu = (None, None)
            else:
                seconds = [detect_with_group(root) for _ in range(repeats)]
                cpu = quiet_cpu_share(root, quiet_seconds) if quiet_seconds > 0 else (None, None)
    finally:
        ray.shutdown()
    return {"mode": mode, "seen_by": "the call" if mode == "no-restart" else path, "repeats": repeats,
            "median_seconds": statistics.median(seconds), "min_seconds": min(seconds), "max_seconds": max(seconds),
            "seconds": seconds, "driver_cpu_share": cpu[0], "ray_cpu_share": cpu[1]}


def _group_path() -> str:
    """How this checkout's group watches its ranks on the connected cluster."""
    try:
        from zocheck_ray.actors.names import actor_states
    except ImportError:  # a checkout from before the state API: it read the GCS's actor table
        return "gcs table"
    return "state API" if actor_states() is not None else "the call"


def run(args) -> dict:
    import ray

    rows = [measure(mode, args.repeats, args.quiet_seconds) for mode in args.modes]
    base = next((r for r in rows if r["mode"] == BASELINE), None)
    for row in rows:
        row["over_baseline"] = row["median_seconds"] / base["median_seconds"] if base else None
    return {"benchmark": "detection", "machine": machine(), "ray": ray.__version__, "baseline": BASELINE,
            "load_average": os.getloadavg()[0], "results": rows}


COLUMNS = [("mode", "mode", "s"), ("seen_by", "seen by", "s"), ("repeats", "n", "d"),
           ("median_seconds", "median s", ".3f"), ("min_seconds", "min s", ".3f"), ("max_seconds", "max s", ".3f"),
           ("over_baseline", f"/ {BASELINE}", ".2f"), ("driver_cpu_share", "driver CPU", ".3f"),
           ("ray_cpu_share", "Ray's CPU", ".3f")]


def run_cli(args) -> int:
    doc = run(args)
    print(f"a rank's process killed inside its segment -> the controller's Failure (Ray {doc['ray']}, "
          f"load {doc['load_average']:.1f})")
    print_table(doc["results"], COLUMNS)
    write_json(args.json, doc)
    return 0


def register(bench) -> None:
    b = bench.add_parser("detection", help="how soon a killed rank is seen: state API, failed calls, max_restarts=0")
    b.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--quiet-seconds", type=float, default=5.0,
                   help="a segment in which nobody dies, for the driver's CPU (0: none)")
    b.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    b.set_defaults(func=run_cli)


if __name__ == "__main__":  # run from another checkout: python /path/to/benchmarks/detection.py ...
    parser = argparse.ArgumentParser(prog="detection")
    register(parser.add_subparsers(dest="bench", required=True))
    parsed = parser.parse_args(["detection", *__import__("sys").argv[1:]])
    raise SystemExit(parsed.func(parsed))
