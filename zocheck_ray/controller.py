"""The driver side: placement, the startup profile, monitoring, resyncs and failures.

    import zocheck_ray
    summary = zocheck_ray.run(zocheck_ray.JobConfig(steps=100), fail_at=[40])

The trainer and the shadow share a STRICT_PACK placement group (one node). The
controller drives the trainer in segments of `log_interval` steps; between
segments it reads the shadow's metrics, prints a progress line and resyncs the
shadow when its lag exceeds `max_lag_steps`. A trainer that dies is restarted by
Ray and recovers in its constructor; the controller records how long it took.
"""

from __future__ import annotations

import time
from typing import Callable, Literal

import ray
from pydantic import BaseModel, ConfigDict
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from zocheck_ray.actors.ray_actors import (
    NAMESPACE, ShadowActor, TrainerActor, call_when_alive, shadow_name, trainer_name,
)
from zocheck_ray.config import JobConfig, JobConfigError, check_task
from zocheck_ray.policies import ProfileReport, ProfileSettings, profile_startup
from zocheck_ray.storage import SnapshotStore, StorageError


class Recovery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    failed_at_step: int
    """The step the trainer was at when it was lost."""
    mode: Literal["software", "host", "unplanned"]
    """`software`: the trainer process died; `host`: trainer and shadow were lost (durable storage);
    `unplanned`: a failure nobody injected."""
    recovered_step: int
    """The step the restarted trainer resumed at (the image's step plus the records it replayed)."""
    seconds: float
    """From the failure seen by the controller to the recovered trainer answering."""
    image_source: str
    """Where the image came from: `memory` (the shadow's object-store image) or `durable` (snapshot + log)."""
    image_step: int | None
    """The step of that image."""
    replayed_records: int
    """Records after the image, replayed by the trainer on its own device."""


class RunSummary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str
    """The run's id."""
    steps: int
    """Steps the trainer completed."""
    final_state_hash: str
    """The trainer's `state_hash` after the last step."""
    shadow_state_hash: str
    """The shadow replica's `state_hash` at the same step (equal when the run is exact)."""
    losses: list[tuple[int, float]]
    """(step, training loss of the last step of each segment: the loss at +eps of the perturbed model)."""
    recoveries: list[Recovery]
    """One per trainer loss, in order."""
    metrics: dict
    """The shadow's `ShadowMetrics` after the final snapshot was persisted."""
    publish_us_median: float | None
    """Median time the training loop spends publishing one step record (microseconds)."""
    trainer_seconds_per_step: float
    """Wall time per step seen by the controller (evaluation excluded)."""
    snapshot_interval: int
    """N: steps between shadow snapshots (set, or chosen by the startup profile)."""
    profile: dict | None
    """The startup profile's report (timings, plan), when it ran."""
    storage: str
    """The run's durable storage URL (`<storage>/<run_id>`)."""
    lag_samples: list[tuple[int, int]] = []
    """(step, lag_steps) at each metrics poll, after any resync."""
    step_hashes: dict[int, str] = {}
    """With `hash_every_step`: the trainer's state_hash after each step (the last one computed)."""
    resumed_from_step: int | None = None
    """The step a run found in its durable storage and resumed from; None for a fresh run."""
    task: dict = {}
    """The task: kind, training and held-out rows, metric, tokenizer."""
    metric: str = "accuracy"
    """The held-out metric that tells progress (`accuracy`, or `loss` for language modelling)."""
    evaluations: dict[int, dict[str, float]] = {}
    """Held-out metrics by step: at step 0, every `task.eval_interval` steps and at the last step."""
    metric_before: float | None = None
    """`metric` at the first evaluated step (step 0 for a fresh run)."""
    metric_after: float | None = None
    """`metric` at the last step."""
    eval_seconds: float = 0.0
    """Trainer time spent evaluating (not counted in `trainer_seconds_per_step`)."""


def _check_resources(job: JobConfig) -> int:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    max_cpus = max((n["Resources"].get("CPU", 0) for n in nodes), default=0)
    gpus = max((n["Resources"].get("GPU", 0) for n in nodes), default=0)
    if job.shadow_cpus + 1 > max_cpus:
        raise JobConfigError(f"shadow_cpus={job.shadow_cpus} plus one trainer CPU exceed the largest node "
                             f"({max_cpus:g} CPUs); lower shadow_cpus")
    if job.use_gpu == "yes" and gpus < 1:
        raise JobConfigError("use_gpu=yes but no node of the Ray cluster has a GPU; set use_gpu=auto or no")
    return 1 if (job.use_gpu == "yes" or (job.use_gpu == "auto" and gpus >= 1)) else 0


def start_actors(job: JobConfig, gpus: int, pg: PlacementGroup | None = None, first_bundle: int = 0):
    """Trainer in bundle `first_bundle`, shadow in the next; a new STRICT_PACK group unless `pg` is given."""
    if pg is None:
        bundles = [{"CPU": 1, **({"GPU": gpus} if gpus else {})}, {"CPU": job.shadow_cpus}]
        pg = placement_group(bundles, strategy="STRICT_PACK", name=f"zocheck-{job.run_id}")
    ray.get(pg.ready(), timeout=120)
    payload = job.model_dump(mode="json")
    shadow = ShadowActor.options(
        name=shadow_name(job.run_id), namespace=NAMESPACE, num_cpus=job.shadow_cpus, max_restarts=job.max_restarts,
        max_task_retries=-1,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle + 1),
    ).remote(payload)
    ray.get(shadow.ready.remote())
    trainer = TrainerActor.options(
        name=trainer_name(job.run_id), namespace=NAMESPACE, num_cpus=1, num_gpus=gpus,
        max_restarts=job.max_restarts,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle),
    ).remote(payload)
    return pg, shadow, trainer


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
                    first_step: int = 0) -> ProfileReport:
    """Measure the trainer step, the replay per thread count, the snapshot copy and the
    persistence time in the first training steps (at most 30) and choose N and the threads."""
    settings = profile_settings(job, job.steps - first_step)

    def trainer_step(i: int) -> float:
        progress = ray.get(trainer.run.remote(first_step + i + 1))
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
    ray.get(shadow.end_profile.remote(report.replay_threads, report.snapshot_interval))
    return report


def run(job: JobConfig, fail_at: list[int] | None = None, fail_mode: Literal["software", "host"] = "software",
        progress: Callable[[str], None] | None = print, kill_node: Callable[[], None] | None = None,
        placement_group: PlacementGroup | None = None, first_bundle: int = 0,
        on_segment: Callable[[dict, dict], None] | None = None) -> RunSummary:
    """Run `job` to completion on the connected Ray cluster (a local one is started if none).

    A run whose storage already holds a snapshot of `job.run_id` resumes from it (the newest
    durable image plus the log, exactly). `placement_group`: an existing, reserved group (a Ray
    Tune trial's) whose bundles `first_bundle` (trainer) and `first_bundle + 1` (shadow) the
    actors use; it is left in place. `on_segment(progress, metrics)` is called after each
    segment with the trainer's progress and the shadow's metrics.
    """
    say = progress or (lambda line: None)
    task = check_task(job)  # bad data, labels or a task/model mismatch fail here, before any actor starts
    try:  # an unusable storage URL fails here, before any actor starts
        SnapshotStore(job.run_url, job.storage_options)
    except StorageError as exc:
        raise JobConfigError(f"storage={job.storage!r} cannot be used: {exc}") from exc
    if not ray.is_initialized():
        ray.init(namespace=NAMESPACE, log_to_driver=False)
    if placement_group is None:
        gpus = _check_resources(job)
    else:
        gpus = int(placement_group.bundle_specs[first_bundle].get("GPU", 0))
        if job.use_gpu == "yes" and gpus < 1:
            raise JobConfigError(f"use_gpu=yes but bundle {first_bundle} of the given placement group has no GPU")
    failures = sorted(set(fail_at or []))
    if any(not 0 < f < job.steps for f in failures):
        raise JobConfigError(f"fail_at steps must lie in (0, {job.steps}), got {failures}")
    if job.snapshot_interval is None and failures:
        settings = profile_settings(job)
        profile_steps = max(settings.warmup_steps + settings.timed_steps, settings.replays_needed)
        if failures[0] <= profile_steps:
            raise JobConfigError(f"fail_at step {failures[0]} falls in the startup profile (its first "
                                 f"{profile_steps} steps); fail later or set snapshot_interval")
    pg, shadow, trainer = start_actors(job, gpus, placement_group, first_bundle)
    recoveries: list[Recovery] = []
    losses: list[tuple[int, float]] = []
    profile = None
    step, started, last = 0, time.perf_counter(), None
    steps_timed, seconds_timed = 0, 0.0
    step_hashes: dict[int, str] = {}
    lag_samples: list[tuple[int, int]] = []
    evaluations: dict[int, dict[str, float]] = {}
    eval_seconds = 0.0

    def absorb(p: dict) -> float:
        """Take a trainer progress report's hashes and evaluations; returns its evaluation seconds."""
        nonlocal eval_seconds
        step_hashes.update(p.get("step_hashes") or {})
        evaluations.update(p.get("evaluations") or {})
        eval_seconds += p.get("eval_seconds", 0.0)
        return p.get("eval_seconds", 0.0)

    say(f"run {job.run_id}: {job.model} {job.dtype} {job.zo.optimizer}, {job.steps} steps, storage {job.run_url}")
    say(f"  task {task.config.kind}: {task.n_train} training rows, {task.n_eval} held-out rows "
        f"({task.metric}), batch {task.config.batch_size}, {task.tokenizer.describe()}")
    started_from = call_when_alive(lambda: trainer.recovery.remote())
    incarnation = started_from["incarnation"]
    resumed_from = started_from["step"] if started_from["source"] != "fresh" else None
    if resumed_from is not None:
        step = resumed_from
        say(f"  resumed from the {started_from['source']} image at step {step}")

    def recovered(failed_at: int, failure_started: float, mode: str) -> None:
        nonlocal step, incarnation
        while True:  # until the restarted trainer (a new incarnation) has recovered in its constructor
            info = call_when_alive(lambda: trainer.recovery.remote())
            if info["incarnation"] != incarnation:
                break
            time.sleep(0.02)
        incarnation = info["incarnation"]
        seconds = time.perf_counter() - failure_started
        recoveries.append(Recovery(failed_at_step=failed_at, mode=mode, recovered_step=info["step"],
                                   seconds=seconds, image_source=info["source"], image_step=info.get("image_step"),
                                   replayed_records=info["replayed_records"]))
        say(f"  trainer lost at step {failed_at} ({mode}); recovered at step {info['step']} from "
            f"{info['source']} image in {seconds:.2f} s ({info['replayed_records']} records replayed)")
        step = info["step"]
        if info.get("state_hash"):
            step_hashes[step] = info["state_hash"]

    try:
        if job.snapshot_interval is None and step < job.steps:
            report = startup_profile(job, trainer, shadow, absorb, first_step=step)
            step += report.training_steps
            profile = report.model_dump(mode="json")
            say(f"  profile ({report.training_steps} steps, {report.profile_seconds:.1f} s): trainer step "
                f"{report.timings.gpu_step_seconds * 1e3:.1f} ms, replay {report.timings.replay_step_seconds * 1e3:.2f} ms "
                f"on {report.replay_threads} threads, snapshot {report.timings.snapshot_cost_seconds * 1e3:.2f} ms, "
                f"persist {report.timings.persist_seconds * 1e3:.0f} ms: {report.plan.regime} regime, "
                f"snapshot every {report.snapshot_interval} steps")
        while step < job.steps:
            target = min(job.steps, (step // job.log_interval + 1) * job.log_interval)
            fail = failures[0] if failures and step < failures[0] <= target else None
            segment_start = time.perf_counter()
            if fail is not None:
                failures.pop(0)
                if fail_mode == "software":
                    try:
                        ray.get(trainer.run.remote(fail + 1, fail))  # the trainer process exits at `fail`
                    except RayActorError:
                        pass
                    else:
                        raise RuntimeError(f"the trainer survived its injected failure at step {fail}")
                    recovered(fail, time.perf_counter(), "software")
                    continue
                absorb(ray.get(trainer.run.remote(fail)))
                started_failure = time.perf_counter()
                (kill_node or _lose_processes(trainer, shadow))()
                recovered(fail, started_failure, "host")
                continue
            try:
                last = ray.get(trainer.run.remote(target))
            except RayActorError:  # a failure nobody injected: Ray restarts the trainer, it recovers
                recovered(step, time.perf_counter(), "unplanned")
                continue
            elapsed = time.perf_counter() - segment_start - absorb(last)
            steps_timed += last["step"] - step
            seconds_timed += elapsed
            step = last["step"]
            losses.append((step, last["loss"]))
            metrics = ray.get(shadow.metrics.remote())
            if metrics["lag_steps"] > job.max_lag_steps:
                packed = ray.get(trainer.export_state.remote())
                ray.get(shadow.resync.remote(packed[:2], packed[2]))
                metrics = ray.get(shadow.metrics.remote())
                say(f"  shadow lagged {metrics['lag_steps']} steps: resynced from the trainer")
            lag_samples.append((step, metrics["lag_steps"]))
            if on_segment is not None:
                on_segment(last, metrics)
            evaluated = max(last.get("evaluations") or {}, default=None)
            held_out = (f"  held-out {task.metric} {last['evaluations'][evaluated][task.metric]:.4f}"
                        if evaluated is not None else "")
            say(f"  step {step:5d}  loss {last['loss']:.4f}  lag {metrics['lag_steps']:3d}  "
                f"snapshot {metrics['snapshot_step']}  durable {metrics['durable_step']}{held_out}")
        final_step, final_hash = ray.get(trainer.state_hash.remote())
        metrics = ray.get(shadow.finish.remote(final_step))
        _, shadow_hash = ray.get(shadow.replica_hash.remote())
        return RunSummary(
            run_id=job.run_id, steps=final_step, final_state_hash=final_hash, shadow_state_hash=shadow_hash,
            losses=losses, recoveries=recoveries, metrics=metrics,
            publish_us_median=(last or {}).get("publish_us_median"),
            trainer_seconds_per_step=seconds_timed / max(steps_timed, 1),
            snapshot_interval=metrics["snapshot_interval"], profile=profile, storage=job.run_url,
            step_hashes=step_hashes, lag_samples=lag_samples, resumed_from_step=resumed_from,
            task=task.summary(), metric=task.metric, evaluations=dict(sorted(evaluations.items())),
            metric_before=evaluations[min(evaluations)][task.metric] if evaluations else None,
            metric_after=evaluations[final_step][task.metric] if final_step in evaluations else None,
            eval_seconds=eval_seconds,
        )
    finally:
        for actor in (trainer, shadow):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if placement_group is None:
            remove_placement_group(pg)
