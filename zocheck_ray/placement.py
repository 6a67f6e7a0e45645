"""Where a run's actors go and how they start: the Ray connection, the cluster check, the placement
groups of the trainer ranks and the shadow, and the startup profile that sets N."""

from __future__ import annotations

import atexit
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from zocheck_ray.actors.ray_actors import NAMESPACE, ShadowActor, TrainerActor, shadow_name, trainer_name
from zocheck_ray.config import JobConfig, JobConfigError
from zocheck_ray.faults import NO_FAULTS, FaultInjection
from zocheck_ray.policies import ProfileReport, ProfileSettings, profile_startup


class RayConnectionError(ConnectionError):
    """The Ray cluster to use cannot be found or reached, or refuses this process; the message says
    which address and what to do."""


def cluster_to_join(address: str | None) -> tuple[str | None, str]:
    """(the GCS address `ray.init(address)` connects to, why that one), or (None, "") when it starts a
    local instance: `address` itself, `RAY_ADDRESS`, or the cluster `ray start` runs on this machine."""
    from ray._private.services import canonicalize_bootstrap_address

    if address == "local":
        return None, ""
    if address not in (None, "auto"):
        return address, "--address"
    try:
        joined = canonicalize_bootstrap_address(address)
    except ConnectionError:  # "auto" and no cluster
        raise RayConnectionError("no Ray cluster found on this machine (RAY_ADDRESS is not set and no `ray start` "
                                 "cluster runs): pass --address HOST:PORT") from None
    except ValueError:
        raise RayConnectionError(f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS')!r} is not the address of a Ray "
                                 "cluster's GCS (HOST:PORT, the `ray start --port`)") from None
    if joined is None:
        return None, ""
    return joined, ("RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "the cluster `ray start` runs on this "
                                                                          "machine")


def _auth_token() -> tuple[str | None, str]:
    """The token Ray would present, and where it comes from (Ray's order: the variable, the file it names,
    ~/.ray/auth_token)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN"
    for path, source in ((os.environ.get("RAY_AUTH_TOKEN_PATH"), "RAY_AUTH_TOKEN_PATH"),
                         (os.path.expanduser("~/.ray/auth_token"), "~/.ray/auth_token")):
        if path and os.path.isfile(path):
            with open(path) as f:
                return f.read().strip(), f"{source} ({path})"
    return None, ""


def check_cluster(address: str, timeout: float = 10.0) -> None:
    """Ask the GCS at `address` (HOST:PORT) for its cluster id, as `ray.init` would first: one quick call
    instead of Ray's retries, each a warning, before a traceback. Raises `RayConnectionError` saying what
    is missing: nothing answers, the cluster wants a token and none is at hand, or it refuses the one at
    hand. When it takes this process's token, Ray is told to present it (RAY_AUTH_MODE=token, if unset)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    def ask(token: str | None):
        with grpc.insecure_channel(address) as channel:
            stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
            try:
                stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout,
                                  metadata=[("authorization", f"Bearer {token}")] if token else None)
            except grpc.RpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    answer = ask(None)
    if answer == grpc.StatusCode.OK:
        return
    if answer != grpc.StatusCode.UNAUTHENTICATED:
        raise RayConnectionError(f"no Ray cluster answers at {address} ({answer.name.lower()}): is it running, and is "
                                 "that its GCS address (the `ray start --port`, 6379 by default)?")
    token, source = _auth_token()
    if token is None:
        raise RayConnectionError(f"the Ray cluster at {address} uses token authentication and no token was found: "
                                 "set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to its token (`ray get-auth-token` "
                                 "on its head prints it)")
    if ask(token) != grpc.StatusCode.OK:
        raise RayConnectionError(f"the Ray cluster at {address} refuses the token from {source}: set RAY_AUTH_TOKEN "
                                 "to its token (`ray get-auth-token` on its head prints it)")
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is None:  # as Ray does when it turns token authentication on for a local instance
        from ray._raylet import Config

        os.environ["RAY_AUTH_MODE"] = mode = "token"
        Config.initialize("")
    if mode != "token":
        raise RayConnectionError(f"the Ray cluster at {address} uses token authentication, but RAY_AUTH_MODE={mode} "
                                 f"keeps Ray from sending the token from {source}: set RAY_AUTH_MODE=token")


def _local_runs_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"zocheck-ray-{os.getuid()}" / "local-runs"


def record_local_instance(run_id: str, address: str) -> None:
    """Note, for `zocheck-ray status RUN_ID` on this machine, that `run_id` runs on the local instance at
    `address`, which this process started (a local instance is not found as a `ray start` cluster is).
    The note goes when this process ends; one left by a killed process is recognised by its pid."""
    directory = _local_runs_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{run_id}.json"
    path.write_text(json.dumps({"address": address, "pid": os.getpid()}))
    atexit.register(path.unlink, missing_ok=True)


def recorded_address(run_id: str) -> str | None:
    """The address of the local instance a running process started for `run_id` (`record_local_instance`)."""
    try:
        record = json.loads((_local_runs_dir() / f"{run_id}.json").read_text())
        os.kill(record["pid"], 0)  # the process that started it still runs
        return record["address"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def connect_ray(address: str | None = None, say: Callable[[str], None] | None = None, run_id: str | None = None,
                **kwargs) -> str | None:
    """`ray.init` in our namespace, worker logs kept out of the driver's output, and Ray's token-
    authentication warning (printed on every local start) replaced by one line of ours, which says
    what was joined and why, or the address of the local instance started (`say`).

    Returns the address of the cluster joined, or None when a local instance was started for this
    process (`address` None and no cluster to join, or "local"); `zocheck-ray status` then finds run
    `run_id` there (`record_local_instance`). Raises `RayConnectionError`, before `ray.init`, when the
    cluster to join cannot be reached or refuses this process."""
    import logging

    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    joined, why = cluster_to_join(address)
    if joined is not None and not joined.startswith("ray://"):
        check_cluster(joined)
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, **kwargs)
    gcs = ray.get_runtime_context().gcs_address
    if joined is None and run_id is not None:
        record_local_instance(run_id, gcs)
    if say is not None:
        if joined is None:
            auth = "on; RAY_AUTH_MODE=disabled turns it off" if os.environ.get("RAY_AUTH_MODE") == "token" else "off"
            say(f"  ray: a local instance for this run at {gcs} (token authentication {auth})")
        else:
            say(f"  ray: joined the cluster at {gcs} ({why})")
    return joined


def _check_resources(job: JobConfig) -> int:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    max_cpus = max((n["Resources"].get("CPU", 0) for n in nodes), default=0)
    gpus = max((n["Resources"].get("GPU", 0) for n in nodes), default=0)
    total_cpus = sum(n["Resources"].get("CPU", 0) for n in nodes)
    total_gpus = sum(n["Resources"].get("GPU", 0) for n in nodes)
    if job.shadow_cpus + 1 > max_cpus:
        raise JobConfigError(f"shadow_cpus={job.shadow_cpus} plus one trainer CPU exceed the largest node "
                             f"({max_cpus:g} CPUs); lower shadow_cpus")
    k = job.trainers
    if k > 1:
        if job.placement == "pack" and k + job.shadow_cpus > max_cpus:
            raise JobConfigError(f"trainers={k} with placement=pack needs one node with {k} trainer CPUs plus "
                                 f"shadow_cpus={job.shadow_cpus}, but the largest node has {max_cpus:g} CPUs; "
                                 "lower trainers or set placement=spread")
        if k + job.shadow_cpus > total_cpus:
            raise JobConfigError(f"trainers={k} plus shadow_cpus={job.shadow_cpus} need {k + job.shadow_cpus} CPUs, "
                                 f"but the cluster has {total_cpus:g}; lower trainers")
    if job.use_gpu == "yes" and gpus < 1:
        raise JobConfigError("use_gpu=yes but no node of the Ray cluster has a GPU; set use_gpu=auto or no")
    placeable = (gpus if job.placement == "pack" else total_gpus) >= k
    if job.use_gpu == "yes" and not placeable:
        raise JobConfigError(f"use_gpu=yes and trainers={k} need {k} GPUs "
                             f"({'on one node' if job.placement == 'pack' else 'in the cluster'}); lower trainers")
    return 1 if (job.use_gpu == "yes" or (job.use_gpu == "auto" and gpus >= 1 and placeable)) else 0


def trainer_bundle(gpus: int) -> dict:
    return {"CPU": 1, **({"GPU": gpus} if gpus else {})}


def job_bundles(job: JobConfig, gpus: int) -> list[dict]:
    """The bundles a job reserves: rank 0, the shadow, then ranks 1..k-1."""
    return [trainer_bundle(gpus), {"CPU": job.shadow_cpus}] + [trainer_bundle(gpus)] * (job.trainers - 1)


def rank_placements(job: JobConfig, gpus: int, pg: PlacementGroup | None = None,
                    first_bundle: int = 0) -> tuple[list[PlacementGroup], list[tuple[PlacementGroup, int]]]:
    """(the groups created here, (group, bundle) of the shadow then of each rank).

    `pack`: one STRICT_PACK group for everything. `spread`: rank 0 and the shadow in a
    STRICT_PACK group, the other ranks in a SPREAD group (any node). A given `pg` (a Tune
    trial's) holds them all from `first_bundle` on, as `job_bundles` orders them."""
    if pg is not None:
        return [], [(pg, first_bundle + 1), (pg, first_bundle)] + [(pg, first_bundle + 1 + r)
                                                                  for r in range(1, job.trainers)]
    if job.placement == "pack" or job.trainers == 1:
        pg = placement_group(job_bundles(job, gpus), strategy="STRICT_PACK", name=f"zocheck-{job.run_id}")
        return [pg], [(pg, 1), (pg, 0)] + [(pg, 1 + r) for r in range(1, job.trainers)]
    home = placement_group(job_bundles(job, gpus)[:2], strategy="STRICT_PACK", name=f"zocheck-{job.run_id}")
    others = placement_group([trainer_bundle(gpus)] * (job.trainers - 1), strategy="SPREAD",
                             name=f"zocheck-{job.run_id}-ranks")
    return [home, others], [(home, 1), (home, 0)] + [(others, r - 1) for r in range(1, job.trainers)]


def start_actors(job: JobConfig, gpus: int, pg: PlacementGroup | None = None, first_bundle: int = 0,
                 faults: FaultInjection = NO_FAULTS):
    """The shadow, then the trainer ranks, in their placement groups (see `rank_placements`).

    Returns (the placement groups created here, the shadow, the trainer of each rank)."""
    groups, places = rank_placements(job, gpus, pg, first_bundle)
    for group in groups or [pg]:
        ray.get(group.ready(), timeout=120)
    payload, injected = job.model_dump(mode="json"), faults.model_dump()
    (shadow_pg, shadow_bundle), rank_places = places[0], places[1:]
    shadow = ShadowActor.options(
        name=shadow_name(job.run_id), namespace=NAMESPACE, num_cpus=job.shadow_cpus, max_restarts=job.max_restarts,
        max_task_retries=-1,
        scheduling_strategy=PlacementGroupSchedulingStrategy(shadow_pg, placement_group_bundle_index=shadow_bundle),
    ).remote(payload, injected)
    ray.get(shadow.ready.remote())
    trainers = [TrainerActor.options(
        name=trainer_name(job.run_id, rank), namespace=NAMESPACE, num_cpus=1, num_gpus=gpus,
        max_restarts=job.max_restarts,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle),
    ).remote(payload, injected, rank) for rank, (group, bundle) in enumerate(rank_places)]
    return groups, shadow, trainers


def _lose_processes(trainer, shadow) -> Callable[[], None]:
    """Host-failure emulation on a cluster whose nodes cannot be removed: both processes
    die with the shadow's in-memory images, so the pair must come back from durable storage."""

    def kill() -> None:
        for actor in (shadow, trainer):
            ray.kill(actor, no_restart=False)

    return kill


def profile_settings(job: JobConfig, remaining_steps: int | None = None) -> ProfileSettings:
    return ProfileSettings(thread_counts=tuple(range(1, job.shadow_cpus + 1)), warmup_steps=2, timed_steps=5,
                           replay_repeats=2, max_training_steps=min(30, job.steps if remaining_steps is None
                                                                   else remaining_steps))


def startup_profile(job: JobConfig, trainer, shadow, on_progress: Callable[[dict], None],
                    first_step: int = 0, train_to: Callable[[int], dict] | None = None) -> ProfileReport:
    """Measure the trainer step, the replay per thread count, the snapshot copy and the
    persistence time in the first training steps (at most 30) and choose N and the threads.
    `train_to(step)`: how to train every rank to `step` (data parallel); rank 0's progress is timed."""
    settings = profile_settings(job, job.steps - first_step)

    def trainer_step(i: int) -> float:
        progress = (train_to or (lambda step: ray.get(trainer.run.remote(step))))(first_step + i + 1)
        on_progress(progress)
        return progress["step_seconds"][-1] if progress["step_seconds"] else 0.0

    def replay_step(i: int, threads: int) -> float:
        seconds = ray.get(shadow.profile_replay.remote(threads))
        return seconds if seconds is not None else 0.0

    def persist() -> float:
        seconds = ray.get(shadow.last_persist_seconds.remote())
        return seconds if seconds is not None else 0.0

    report = profile_startup(trainer_step=trainer_step, replay_step=replay_step,
                             snapshot_copy=lambda: ray.get(shadow.profile_snapshot.remote()),
                             persist=persist, settings=settings)
    ray.get(shadow.end_profile.remote(report.replay_threads, report.snapshot_interval, report.plan.regime))
    return report
