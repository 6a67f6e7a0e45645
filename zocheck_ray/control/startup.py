"""The one start-up check: everything a run needs, found before any actor starts, so that a job that cannot run
fails at once. It builds the task once; the trainers take it through Ray's object store."""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Callable

import ray
from ray.util.placement_group import PlacementGroup

from zocheck_ray.actors.names import NAMESPACE, describe_actor, shadow_name
from zocheck_ray.actors.link import shadow_writer
from zocheck_ray.config import JobConfig, JobConfigError
from zocheck_ray.actors.connect import connect_ray
from zocheck_ray.control.faults import FaultPlan, PlacedFaults
from zocheck_ray.control.identity import Recording, check_identity
from zocheck_ray.control.placement import _check_resources, running_here
from zocheck_ray.storage import LeaseHeldError, StorageError, check_no_live_writer, check_run_rules
from zocheck_ray.storage.fs import open_storage, parse_url
from zocheck_ray.storage.probe import check_writable
from zocheck_ray.storage.snapshot import SNAPSHOTS_DIR, SnapshotStore, snapshot_dir
from zocheck_ray.workload.custom import Workload
from zocheck_ray.workload.errors import WorkloadError


@dataclasses.dataclass(frozen=True)
class Startup:
    """What the start-up check found: the run's inputs, devices and resume point."""

    task: object
    """The job's task (`zocheck_ray.workload.Task`), built once, here."""
    gpus: int
    """The GPUs each trainer gets (0: it trains on a CPU)."""
    resume_step: int | None
    """The step the run resumes at from its storage (None: a fresh run)."""
    faults: PlacedFaults | None
    """The failures the run deals itself, placed after `resume_step`."""
    identity: Recording | None = None
    """The run's identity to write, once the job has claimed the run (`Placement.start`): a job refused then
    writes nothing."""
    model_init: object = None
    """The job's model as a function every trainer calls (`workload.model_init.ModelInit`), or None."""
    handed_over: bool = False
    """Whether the task holds rows or functions handed over in Python, which the trainers take from the driver."""


def check_run(job: JobConfig, say: Callable[[str], None] | None, placement_group: PlacementGroup | None = None,
              first_bundle: int = 0, faults: FaultPlan | None = None, address: str | None = None,
              workload: Workload | None = None) -> Startup:
    """Build `job`'s task, check its storage and place `faults` before Ray starts, then connect and check that the
    run is its storage's only writer and fits the cluster. Raises `JobConfigError` naming what cannot work."""
    task = build_task_once(job, workload)
    try:
        check_writable(job.run_url, job.storage_options)  # its root and every directory of it a run writes in
        check_run_rules(job.run_url, job.storage_options)  # a run stored under other update rules
        check_snapshots_whole(job)
    except StorageError as exc:
        raise JobConfigError(f"storage={job.storage!r} cannot be used: {exc}") from exc
    check_storage_room(job)
    resumes = resume_step(job)
    identity = check_identity(job, task, resumes, say or (lambda line: None))
    placed = faults.place(job, resumes, say or (lambda line: None)) if faults is not None else None
    if not ray.is_initialized():
        connect_ray(address, say=say, run_id=job.run_id)
    try:  # another live writer of this run's storage is refused, named; this cluster's dead shadow is not
        check_no_live_writer(job.run_url, job.storage_options)
        held = None
    except LeaseHeldError as exc:
        if exc.holder is None or exc.holder.owner != shadow_writer(job.run_id):
            raise JobConfigError(f"storage={job.storage!r}: {exc}") from exc
        held = exc
    check_not_running_here(job, held)
    return Startup(task, _devices(job, placement_group, first_bundle), resumes, placed, identity,
                   workload.model_init if workload is not None else None, workload is not None)


def _devices(job: JobConfig, placement_group: PlacementGroup | None, first_bundle: int) -> int:
    if placement_group is None:
        return _check_resources(job)
    gpus = int(placement_group.bundle_specs[first_bundle].get("GPU", 0))
    if job.scaling.use_gpu == "yes" and gpus < 1:
        raise JobConfigError(f"scaling.use_gpu=yes but bundle {first_bundle} of the given placement group has no GPU")
    if len(placement_group.bundle_specs) < first_bundle + 1 + job.scaling.trainers:
        raise JobConfigError(f"scaling.trainers={job.scaling.trainers} need {job.scaling.trainers + 1} bundles from "
                             f"bundle {first_bundle} "
                             f"of the given placement group (rank 0, the shadow, ranks 1..), which has "
                             f"{len(placement_group.bundle_specs)}")
    return gpus


def build_task_once(job: JobConfig, workload: Workload | None = None):
    """`job`'s task, every row read and the model's fit checked, without building the model; `JobConfigError`
    names the field, file and line."""
    from zocheck_ray.workload.builder import build_task

    check_peft(job)
    try:
        return workload.build(job.task, job.model) if workload is not None else build_task(job.task, job.model)
    except WorkloadError as exc:
        raise JobConfigError(f"task ({job.task.kind} on model {job.model!r}): {exc}") from exc


def check_peft(job: JobConfig) -> None:
    """Refuse an adapter the model cannot take, or a quantized base that cannot load, run or give the same bits
    twice."""
    if job.peft is None:
        return
    from zocheck_ray.workload.adapters import check_adapter

    check_quantization(job)

    try:
        check_adapter(job.peft, job.model)
    except WorkloadError as exc:
        raise JobConfigError(f"peft ({job.peft.method} on model {job.model!r}): {exc}") from exc
    if job.peft.method == "prefix":  # the virtual tokens take positions: a learned position table must hold them
        from zocheck_ray.workload.models import model_config_dict

        hf = model_config_dict(job.model)
        positions, tokens = hf.get("max_position_embeddings"), job.peft.num_virtual_tokens
        if positions and not any("rope" in key for key in hf) and job.task.max_length + tokens > positions:
            raise JobConfigError(f"peft.num_virtual_tokens={tokens} plus task.max_length={job.task.max_length} "
                                 f"exceed model {job.model!r}'s max_position_embeddings={positions} (learned "
                                 f"positions); lower task.max_length to {max(2, positions - tokens)} or "
                                 "peft.num_virtual_tokens")


def check_quantization(job: JobConfig) -> None:
    """The quantized base's probe on the trainers' kind of device where this process has it; else its backend's
    installation only."""
    if job.quantization is None:
        return
    import torch

    from zocheck_ray.workload.quantized.probe import check_quantized

    cuda = torch.cuda.is_available() and job.scaling.use_gpu != "no"
    device = "cuda" if cuda else ("cpu" if job.scaling.use_gpu != "yes" else None)
    try:
        check_quantized(job.model, job.quantization, job.dtype, job.run_seed, job.peft.method == "qzo", device)
    except WorkloadError as exc:
        raise JobConfigError(f"quantization ({job.quantization.describe()} on model {job.model!r}): {exc}") from exc


def resume_step(job: JobConfig) -> int | None:
    """The step a run of `job` resumes at from its storage, or None for a fresh run, so a planned failure lies
    after it."""
    from zocheck_ray.storage.steplog import read_records

    try:
        store = SnapshotStore(job.run_url, job.storage_options, create=False)
        latest = store.latest()
        if latest is None:
            return None
        return latest.step + len(read_records(store.storage, after_step=latest.step - 1))
    except (StorageError, ValueError):  # no storage yet, or damage the run itself reports
        return None


STORAGE_MARGIN_BYTES = 1 << 20
"""Room kept for the step log and the lease beside the snapshots."""


def snapshot_bytes(job: JobConfig) -> int | None:
    """The bytes of one snapshot of `job`'s trained state, counted on the meta device; None where not cheap."""
    from zocheck_ray.core import ZOOptimizer
    from zocheck_ray.workload.models import build_model, trainable_parameters
    from zocheck_ray.workload.names import MODEL_INIT_PREFIX, model_directory
    from zocheck_ray.workload.weights import checkpoint_files

    directory = model_directory(job.model)
    if job.peft is not None or (directory is not None and checkpoint_files(directory) is None) \
            or job.model.startswith(MODEL_INIT_PREFIX):
        return None  # an adapter's snapshots are small; a directory without safetensors, or a model_init, would
        # build the whole model

    model = build_model(job.model, job.dtype, device="meta", weights="none")
    state = ZOOptimizer(trainable_parameters(model), job.zo).state_tensors()
    return sum(t.numel() * t.element_size() for t in state.values())


def check_storage_room(job: JobConfig) -> None:
    """Refuse local storage without room for the snapshots a run writes side by side, so a full disk fails here,
    not in a shadow's retries."""
    scheme, root = parse_url(job.run_url)
    if scheme != "file" or (size := snapshot_bytes(job)) is None:
        return
    snapshots = os.path.join(root, SNAPSHOTS_DIR)
    kept = 1 if job.task.num_dev is not None else 0  # the best dev step's, pinned
    needed = size * (kept + (1 if os.path.isdir(snapshots) and os.listdir(snapshots) else 2)) + STORAGE_MARGIN_BYTES
    free = shutil.disk_usage(root).free
    if free < needed:
        raise JobConfigError(f"storage={job.storage!r}: {root} has {free} bytes free, and this run needs {needed} "
                             f"(snapshots of {size} bytes, the newest written beside the one before"
                             f"{', the best dev step' if kept else ''}, and the log); "
                             "free space there or choose another --storage")


def check_snapshots_whole(job: JobConfig) -> None:
    """Refuse storage whose every committed snapshot lacks a file or has one of the wrong size; sizes only, since
    the shadow checks each file's SHA-256 as it reads it."""
    if SNAPSHOTS_DIR not in open_storage(job.run_url, job.storage_options, create=False).list_dir(""):
        return
    damaged = []
    with SnapshotStore(job.run_url, job.storage_options, create=False) as store:
        for info in store.committed():
            if (problem := _size_problem(store, info)) is None:
                return
            damaged.append(problem)
    if damaged:
        raise JobConfigError(f"storage={job.storage!r} cannot be resumed: every committed snapshot under {store.url} "
                             f"is damaged: {'; '.join(damaged)}; nothing was deleted: restore the damaged files from "
                             "a copy, or start the job under another run_id or storage")


def _size_problem(store: SnapshotStore, info) -> str | None:
    for name, entry in info.manifest.files.items():
        rel = f"{snapshot_dir(info.step)}/{name}"
        try:
            size = store.storage.size(rel)
        except FileNotFoundError:
            return f"{store.storage.url_of(rel)} is missing"
        if size != entry.size:
            return f"{store.storage.url_of(rel)} holds {size} bytes where its manifest says {entry.size}"
    return None


def check_not_running_here(job: JobConfig, held: LeaseHeldError | None = None) -> None:
    """Refuse a job whose run id a job on this cluster already uses, naming it by its shadow; `held`: the run's
    lease, held by that shadow."""
    name = shadow_name(job.run_id)
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:  # no such actor: none, or dead
        return
    holder = f"its shadow {name} is {describe_actor(name)}"
    if held is not None and held.holder is not None:
        holder += f", and holds the lease of {job.run_url}: {held.holder.describe()}"
    raise running_here(job, holder)
