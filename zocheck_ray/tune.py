"""Ray Tune: one ZOCheck job per trial, restored exactly from the trial's durable image.

    from zocheck_ray.config import load_job_config
    from zocheck_ray.tune import sweep

    job = load_job_config("deploy/examples/sst2-opt.yaml")
    results = sweep(job, {"zo.lr": [1e-3, 3e-3], "zo.eps": [1e-3, 1e-2]})

    zocheck-ray tune --config deploy/examples/sst2-opt.yaml --grid zo.lr=1e-3,3e-3 --grid zo.eps=1e-3,1e-2

Each trial runs one job in its own placement group and reports after every segment. A Tune
checkpoint is a JSON pointer to the run's newest durable snapshot, never the weights, so a
restored trial resumes the same run and ends bit for bit where an uninterrupted one would.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from zocheck_ray.config import (
    JobConfig,
    JobConfigError,
    check_job_environment,
    join_run_url,
    with_absolute_paths,
    load_job_config,
)

POINTER_FILE = "zocheck_pointer.json"
"""The only file in a ZOCheck Tune checkpoint."""

TRAINABLE_BUNDLE = {"CPU": 1}
"""The trial's controller process, which mostly waits on the actors."""


class CheckpointPointerError(ValueError):
    """A Tune checkpoint that does not point at a usable durable ZOCheck image; the message names it."""


class TrialResourcesError(JobConfigError):
    """No node of the Ray cluster can hold one trial's placement group; the message says what is missing."""


class CheckpointPointer(BaseModel):
    """What a Tune checkpoint holds: where the trial's durable image is, and which one it was."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["zocheck-ray/durable-image"] = "zocheck-ray/durable-image"
    """Identifies the file."""
    storage: str
    """The job's storage root (credentials stay in the job's `storage_options`)."""
    run_id: str
    """The run, under `<storage>/<run_id>`."""
    step: int = Field(ge=0)
    """The newest durable snapshot at the report."""
    state_hash: str = Field(min_length=64, max_length=64)
    """That snapshot's state_hash."""

    @property
    def run_url(self) -> str:
        return join_run_url(self.storage, self.run_id)


def write_pointer(pointer: CheckpointPointer, directory: str | Path) -> Path:
    path = Path(directory) / POINTER_FILE
    path.write_text(pointer.model_dump_json(indent=2))
    return path


def read_pointer(directory: str | Path) -> CheckpointPointer:
    """The pointer in a checkpoint directory."""
    path = Path(directory) / POINTER_FILE
    if not path.is_file():
        raise CheckpointPointerError(f"{path} does not exist: the checkpoint is not a ZOCheck trial's")
    try:
        return CheckpointPointer.model_validate_json(path.read_text())
    except ValidationError as exc:
        raise CheckpointPointerError(f"{path} is not a valid ZOCheck checkpoint pointer:\n{exc}") from exc


def durable_pointer(job: JobConfig) -> CheckpointPointer | None:
    """A pointer to the newest committed snapshot of `job`'s run, or None before the first."""
    from zocheck_ray.storage import SnapshotStore

    latest = SnapshotStore(job.run_url, job.storage_options, create=False).latest()
    if latest is None:
        return None
    return CheckpointPointer(storage=job.storage, run_id=job.run_id, step=latest.step, state_hash=latest.state_hash)


def check_pointer(pointer: CheckpointPointer, storage_options: dict) -> None:
    """Fail unless the storage still holds the run the pointer names, at its step or later."""
    from zocheck_ray.storage import SnapshotStore, StorageError

    try:
        store = SnapshotStore(pointer.run_url, storage_options, create=False)
        committed = store.committed()
    except StorageError as exc:
        raise CheckpointPointerError(f"checkpoint points at {pointer.run_url}, which cannot be read: {exc}") from exc
    if not committed or committed[0].step < pointer.step:
        newest = committed[0].step if committed else None
        raise CheckpointPointerError(f"checkpoint points at step {pointer.step} of {pointer.run_url}, but its newest "
                                     f"committed snapshot is {newest}: the durable storage was changed or lost")
    for info in committed:
        if info.step == pointer.step and info.state_hash != pointer.state_hash:
            raise CheckpointPointerError(f"checkpoint says step {pointer.step} of {pointer.run_url} has state_hash "
                                         f"{pointer.state_hash}, the snapshot there has {info.state_hash}")


def trial_resources(job: JobConfig, gpus: int = 0):
    """One trial's placement-group factory: controller, trainer (`gpus` GPUs), shadow, further ranks;
    STRICT_PACK, or PACK with `scaling.placement: spread`."""
    from ray.tune import PlacementGroupFactory

    from zocheck_ray.control.placement import job_bundles

    return PlacementGroupFactory([TRAINABLE_BUNDLE, *job_bundles(job, gpus)],
                                 strategy="STRICT_PACK" if job.scaling.placement == "pack" else "PACK")


def check_cluster_fits_a_trial(job: JobConfig, gpus: int, nodes: list[dict]) -> None:
    """Raise `TrialResourcesError` unless one alive node of `nodes` (`ray.nodes()`) holds a whole trial,
    which Tune would otherwise leave PENDING forever."""
    bundles = trial_resources(job, gpus).bundles
    need = {kind: sum(b.get(kind, 0) for b in bundles) for kind in ("CPU", "GPU")}
    alive = [n["Resources"] for n in nodes if n.get("Alive")]
    if any(all(r.get(kind, 0) >= amount for kind, amount in need.items()) for r in alive):
        return
    largest = max(alive, key=lambda r: (r.get("GPU", 0) >= need["GPU"], r.get("CPU", 0)), default={})
    have_cpus, have_gpus = largest.get("CPU", 0), largest.get("GPU", 0)
    wanted = f"{need['CPU']:g} CPUs" + (f" and {need['GPU']:g} GPU" if need["GPU"] else "")
    fixes = []
    if job.shadow.cpus > 1 and have_cpus >= 3:
        fixes.append(f"lower shadow.cpus to {max(1, int(have_cpus) - 2)} (--set shadow.cpus=N)")
    elif job.shadow.cpus > 1:
        fixes.append("lower shadow.cpus (--set shadow.cpus=1)")
    if have_cpus < need["CPU"]:
        fixes.append(f"give Ray {need['CPU']:g} logical CPUs on a node (a local instance: zocheck-ray tune "
                     f"--num-cpus {need['CPU']:g}, or ray.init(num_cpus={need['CPU']:g}); a cluster node: "
                     f"ray start --num-cpus={need['CPU']:g})")
    if need["GPU"] and have_gpus < need["GPU"]:
        fixes.append("add a node with a GPU, or set scaling.use_gpu=no")
    raise TrialResourcesError(
        f"a trial needs {wanted} on one node (its controller 1 CPU, the trainer 1 CPU"
        + (f" and {need['GPU']:g} GPU" if need["GPU"] else "") + f", the shadow shadow.cpus={job.shadow.cpus}), "
        f"but the largest node of this Ray cluster has {have_cpus:g} CPUs"
        + (f" and {have_gpus:g} GPUs" if need["GPU"] else "")
        + " and Tune would leave every trial PENDING: " + "; or ".join(fixes))


def trial_job(job: dict, config: dict, trial_id: str) -> JobConfig:
    """The base job with the trial's dotted overrides (`{"zo.lr": 1e-3}`) and its own run id."""
    doc = json.loads(json.dumps(job))
    doc["run_id"] = f"{job['run_id']}-{trial_id}"
    for dotted, value in config.items():
        *sections, field = dotted.split(".")
        node = doc
        for key in sections:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise JobConfigError(f"trial field {dotted!r}: {key!r} is not a section of JobConfig")
        node[field] = value
    try:
        return JobConfig.model_validate(doc)
    except ValidationError as exc:
        raise JobConfigError(f"the trial {config} makes an invalid job:\n{exc}") from exc


def _scalars(values: dict) -> dict:
    return {k: v for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def train_trial(config: dict, job: dict, callbacks: Sequence = ()) -> None:
    """The Tune trainable: one ZOCheck job, reported after each segment, restorable exactly."""
    from ray import tune

    run_trial(trial_job(job, config, tune.get_context().get_trial_id()), callbacks)


def trial_id() -> str | None:
    """The id of the Tune trial this process runs, or None outside one."""
    import warnings

    from ray import tune

    with warnings.catch_warnings():  # outside a trial Ray warns, and returns None
        warnings.simplefilter("ignore")
        return tune.get_context().get_trial_id()


def run_trial(trial: JobConfig, callbacks: Sequence = (), workload=None, progress=print):
    """Run `trial` as this process's Tune trial, in its placement group, reporting a checkpoint pointer after each
    segment and resuming from it when Tune restores the trial. Returns its `RunSummary`."""
    import ray
    from ray import tune

    from zocheck_ray.control import RunCallback, run

    restored = tune.get_checkpoint()
    last_reported: int | None = None
    if restored is not None:
        with restored.as_directory() as directory:
            pointer = read_pointer(directory)
        check_pointer(pointer, trial.storage_options)
        trial = JobConfig.model_validate({**trial.model_dump(), "run_id": pointer.run_id, "storage": pointer.storage})
        last_reported = pointer.step

    def report(values: dict, durable_step: int | None) -> None:
        nonlocal last_reported
        if durable_step is None or durable_step == last_reported:
            tune.report(values)
            return
        pointer = durable_pointer(trial)
        with tempfile.TemporaryDirectory() as directory:
            write_pointer(pointer, directory)
            tune.report({**values, "checkpoint_step": pointer.step},
                        checkpoint=tune.Checkpoint.from_directory(directory))
        last_reported = durable_step

    held_out: dict[str, float] = {}  # the newest held-out metrics, repeated until the next evaluation

    def absorb(evaluations: dict) -> None:
        if evaluations:
            newest = evaluations[max(evaluations, key=int)]
            held_out.update({f"eval_{name}": value for name, value in _scalars(newest).items()})

    class Reports(RunCallback):
        def on_segment(self, run, segment):
            # every evaluation so far, the step-0 one too (taken during the startup profile): the first report
            # carries every metric a trial can be asked for
            absorb(run.record.evaluations)
            report({**_scalars(segment.metrics.model_dump()), **_scalars(segment.progress.model_dump()), **held_out,
                    "run_id": trial.run_id}, segment.metrics.durable_step)

    group = ray.util.get_current_placement_group()
    if group is None or len(group.bundle_specs) < 2 + trial.scaling.trainers:
        raise JobConfigError(f"the Tune trial of run {trial.run_id!r} has no room for its trainer and shadow: give "
                             "the trainable its resources, tune.with_resources(trainable, "
                             "zocheck_ray.tune.trial_resources(job))")
    summary = run(trial, progress=progress, callbacks=[*callbacks, Reports()], placement_group=group, first_bundle=1,
                  workload=workload)
    absorb(summary.evaluations)
    final = {**_scalars(summary.metrics.model_dump()), **held_out, "step": summary.steps, "run_id": trial.run_id,
             "final_state_hash": summary.final_state_hash, "shadow_state_hash": summary.shadow_state_hash,
             "exact": summary.final_state_hash == summary.shadow_state_hash,
             "resumed_from_step": -1 if summary.resumed_from_step is None else summary.resumed_from_step}
    if summary.losses:
        final["loss"] = summary.losses[-1][1]
    report(final, summary.metrics.durable_step)
    return summary


def sweep(job: JobConfig, grid: dict[str, list], *, tune_storage: str | None = None, name: str | None = None,
          max_failures: int = 1, max_concurrent_trials: int | None = None, metric: str = "loss",
          mode: Literal["min", "max"] = "min", param_space: dict[str, Any] | None = None,
          callbacks: Sequence = ()):
    """Run one trial per point of `grid` (dotted JobConfig fields -> values); returns Tune's `ResultGrid`.

    `param_space` adds raw Tune search entries (`{"zo.lr": tune.loguniform(1e-4, 1e-2)}`);
    `tune_storage` holds Tune's experiment state (default `~/ray_results`).
    """
    import ray
    from ray import tune

    if not grid and not param_space:
        raise JobConfigError("a sweep needs at least one field in grid or param_space")
    space: dict[str, Any] = {key: tune.grid_search(list(values)) for key, values in grid.items()}
    space.update(param_space or {})
    from zocheck_ray.control.startup import build_task_once

    build_task_once(job)
    for key, values in grid.items():  # every point must be a valid job, its task too, before any trial starts
        for value in values:
            point = trial_job(job.model_dump(mode="json"), {key: value}, "check")
            if key.split(".")[0] in ("task", "model", "peft"):
                build_task_once(point)
    if not ray.is_initialized():
        from zocheck_ray.actors.names import NAMESPACE

        ray.init(namespace=NAMESPACE, log_to_driver=False)
    use_gpu = job.scaling.use_gpu
    gpus = 1 if use_gpu == "yes" or (use_gpu == "auto" and ray.cluster_resources().get("GPU", 0) >= 1) else 0
    check_cluster_fits_a_trial(job, gpus, ray.nodes())
    trainable = tune.with_resources(tune.with_parameters(train_trial, job=with_absolute_paths(job).model_dump(mode="json"),
                                                         callbacks=list(callbacks)), trial_resources(job, gpus))
    tuner = tune.Tuner(
        trainable, param_space=space,
        tune_config=tune.TuneConfig(metric=metric, mode=mode, max_concurrent_trials=max_concurrent_trials),
        run_config=tune.RunConfig(
            name=name or f"zocheck-{job.run_id}",
            storage_path=os.path.abspath(tune_storage) if tune_storage and "://" not in tune_storage else tune_storage,
            failure_config=tune.FailureConfig(max_failures=max_failures),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
            verbose=1,
        ),
    )
    return tuner.fit()


# ---------------------------------------------------------------------------- command line

def _value(text: str) -> Any:
    try:  # JSON first: YAML 1.1 reads 1e-3 as a string
        return json.loads(text)
    except ValueError:
        return yaml.safe_load(text)


def _grid_entry(text: str) -> tuple[str, list]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--grid {text!r}: expected field=v1,v2,...")
    key, raw = text.split("=", 1)
    values = [_value(v.strip()) for v in raw.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"--grid {text!r}: no values")
    return key.strip(), values


def tune_command(args: argparse.Namespace) -> int:
    import ray

    from zocheck_ray.actors.names import NAMESPACE

    try:
        if args.num_cpus is not None and args.num_cpus < 1:
            raise JobConfigError(f"--num-cpus must be at least 1, got {args.num_cpus}")
        if args.address and args.num_cpus:
            raise JobConfigError("--num-cpus sizes a local Ray instance; a cluster (--address) has its own "
                                 "(ray start --num-cpus=N on its nodes)")
        if args.num_cpus and not args.address:
            from zocheck_ray.actors.connect import cluster_to_join

            joined, why = cluster_to_join(None)
            if joined is not None:  # ray.init would join it, and refuse num_cpus there
                raise JobConfigError(f"--num-cpus sizes a local Ray instance, but this sweep joins the cluster at "
                                     f"{joined} ({why}): give that cluster's node the CPUs (ray stop, then ray start "
                                     f"--head --num-cpus={args.num_cpus}), or start a local instance for the sweep "
                                     "with RAY_ADDRESS=local")
        job = load_job_config(args.config, args.set, steps=args.steps, storage=args.storage)
        check_job_environment(job)
        if args.address:
            ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False)
        elif args.num_cpus:
            ray.init(address="local", num_cpus=args.num_cpus, namespace=NAMESPACE, log_to_driver=False)
        results = sweep(job, dict(args.grid), tune_storage=args.tune_storage, max_failures=args.max_failures,
                        metric=args.metric, mode=args.mode)
    except (JobConfigError, CheckpointPointerError) as exc:
        print(f"zocheck-ray tune: {exc}", file=sys.stderr)
        return 2
    keys = [key for key, _ in args.grid]
    rows = summarize(results, keys, args.metric)
    print()
    print(format_table(rows, keys, args.metric))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.json}")
    return 0 if rows and all(r["exact"] and not r["error"] for r in rows) else 1


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"  # metrics and swept values to 4 significant digits
    return str(value)


def format_table(rows: list[dict], keys: list[str], metric: str) -> str:
    """The sweep's final table, one line per trial."""
    header = [*keys, "run_id", "step", metric, "exact", "state_hash"]
    cells = [header] + [[_cell(row.get(h)) if h != "state_hash" else (row.get(h) or "-")[:16] for h in header]
                        for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    numeric = {"step", metric}
    lines = []
    for n, line in enumerate(cells):
        text = "  ".join(cell.rjust(width) if header[i] in numeric else cell.ljust(width)
                         for i, (cell, width) in enumerate(zip(line, widths)))
        error = rows[n - 1]["error"] if n else None
        lines.append(("  " + text + (f"  error: {error}" if error else "")).rstrip())
    return "\n".join(lines)


def summarize(results, keys: list[str], metric: str) -> list[dict]:
    """One row per trial of a `ResultGrid`: its swept values, run, step, metric, final state_hash."""
    rows = []
    for result in results:
        m = result.metrics or {}
        rows.append({**{k: result.config.get(k) for k in keys}, "run_id": m.get("run_id"), "step": m.get("step"),
                     metric: m.get(metric), "state_hash": m.get("final_state_hash"), "exact": m.get("exact"),
                     "resumed_from_step": m.get("resumed_from_step"),
                     "error": str(result.error) if result.error else None})
    return rows


def register(commands) -> None:
    p = commands.add_parser("tune", help="a Ray Tune sweep: one ZOCheck job per trial, restored exactly",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="base job YAML (see JobConfig)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a base config field")
    p.add_argument("--grid", action="append", type=_grid_entry, required=True, metavar="FIELD=V1,V2",
                   help="sweep a dotted JobConfig field over these values (repeat for a grid)")
    p.add_argument("--steps", type=int)
    p.add_argument("--storage", help="durable storage root URL for every trial's run")
    p.add_argument("--tune-storage", help="where Tune keeps its experiment state (default ~/ray_results)")
    p.add_argument("--max-failures", type=int, default=1, help="restores per trial after a failure")
    p.add_argument("--metric", default="loss")
    p.add_argument("--mode", choices=["min", "max"], default="min")
    p.add_argument("--address", help="Ray cluster address (default: start a local one)")
    p.add_argument("--num-cpus", type=int, metavar="N",
                   help="logical CPUs of the local Ray instance (default: the machine's cores); a trial needs "
                        "2 + shadow.cpus on one node")
    p.add_argument("--json", metavar="FILE", help="write one row per trial as JSON")
    p.set_defaults(func=tune_command)
