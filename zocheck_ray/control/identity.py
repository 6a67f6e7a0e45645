"""A run's identity: what a resume must share with the run it resumes, checked before Ray starts.

`identity.json` beside the run's snapshots holds the settings that decide what a step computes (`RunIdentity`).
Once the run commits a snapshot, a start whose job differs in any of them is refused, naming the field and both
values. The step records carry lr, eps and weight decay, so a change of those is allowed, as `transformers.Trainer`
allows it on resume, and recorded with the step it took effect.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from zocheck_ray.config import JobConfig, JobConfigError
from zocheck_ray.runtime.parallel.shards import shard_count
from zocheck_ray.storage.fs import open_storage

IDENTITY_FILE = "identity.json"
HYPERPARAMETERS = ("lr", "eps", "weight_decay")
"""`zo.` fields every step record carries: a resume may change them."""
NOT_TRAINED_ON = ("data_path", "data_format", "split", "eval_path", "eval_split", "eval_size", "eval_interval",
                  "eval_batch_size", "num_eval", "eval_generations", "max_new_tokens", "micro_batch_size")
"""`task.` fields that change no training step: where the rows are read from (their fingerprint is checked),
evaluation, and micro-batches."""


class HyperparameterChange(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    step: int
    """The first step trained with the new value."""
    field: str
    old: float
    new: float


class RunIdentity(BaseModel):
    """What every step of a run depends on besides its records."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    weights: str
    """How the initial weights were made: a model directory's weight files (hashed headers and sizes), a built-in's
    seed, or a `model_init`'s parameter layout."""
    dtype: str
    task: dict[str, Any]
    data: str
    """SHA-256 of the training rows."""
    optimizer: dict[str, Any]
    """`zo` without the hyperparameters the records carry."""
    peft: dict[str, Any] | None
    quantization: dict[str, Any] | None = None
    """The base's quantization (its bits are checked by hash when a trainer loads it)."""
    shards: int
    run_seed: int
    hyperparameters: dict[str, float]
    changes: list[HyperparameterChange] = []


def identity_of(job: JobConfig, task) -> RunIdentity:
    zo = job.zo.model_dump(mode="json")
    return RunIdentity(
        model=job.model, weights=weights_fingerprint(job), dtype=job.dtype,
        task=job.task.model_dump(mode="json", exclude=set(NOT_TRAINED_ON) & set(type(job.task).model_fields)),
        data=data_fingerprint(task), optimizer={k: v for k, v in zo.items() if k not in HYPERPARAMETERS},
        peft=job.peft.model_dump(mode="json") if job.peft is not None else None, shards=shard_count(job),
        quantization=job.quantization.model_dump(mode="json") if job.quantization is not None else None,
        run_seed=job.run_seed, hyperparameters={k: zo[k] for k in HYPERPARAMETERS if k in zo})


def weights_fingerprint(job: JobConfig) -> str:
    from zocheck_ray.workload.names import MODEL_INIT_PREFIX, model_directory

    if job.model.startswith(MODEL_INIT_PREFIX):
        from zocheck_ray.workload.model_init import registered

        init = registered(job.model)
        return f"model_init {init.function}: {init.architecture}, parameter layout {init.layout}"
    directory = model_directory(job.model)
    if directory is None:
        return "built from its config, initialised from run_seed"
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin")):
        with open(path, "rb") as f:
            head = f.read(8)
            size = int.from_bytes(head, "little") if len(head) == 8 and path.suffix == ".safetensors" else 0
            digest.update(path.name.encode() + head + f.read(min(size, 1 << 26)) + str(path.stat().st_size).encode())
    return digest.hexdigest()


def data_fingerprint(task) -> str:
    """The task's own fingerprint of its rows (`sft`, rows handed over), else SHA-256 of its training examples."""
    found = getattr(task, "fingerprint", None)
    if isinstance(found, str) and found:
        return found
    digest = hashlib.sha256()
    for example in task.train_examples:
        digest.update(repr(example).encode() + b"\n")
    return digest.hexdigest()


class Recording:
    """An identity checked and still to be written (`record`), once the run is known to be its storage's only job."""

    def __init__(self, storage, identity: RunIdentity | None):
        self.storage, self.identity = storage, identity

    def record(self) -> None:
        if self.identity is not None:
            self.storage.write_atomic(IDENTITY_FILE, _dump(self.identity))


def check_identity(job: JobConfig, task, resume_step: int | None, say: Callable[[str], None]) -> Recording:
    """Refuse a resume whose job differs from its run's identity (`JobConfigError`); say a changed hyperparameter.
    Returns what to record."""
    storage = open_storage(job.run_url, job.storage_options, create=True)
    mine = identity_of(job, task)
    recorded = _read(storage) if resume_step else None  # a run at step 0 trained nothing: its start may differ
    if recorded is None:
        return Recording(storage, mine)
    for field in RunIdentity.model_fields:
        if field in ("hyperparameters", "changes"):
            continue
        was, now = getattr(recorded, field), getattr(mine, field)
        if was != now:
            raise JobConfigError(f"run {job.run_id!r} under {job.run_url} was trained with {_describe(field, was, now)}"
                                 f": a resume trains what its run trained. Set it back, or give this job another "
                                 f"run_id or storage")
    changes = [HyperparameterChange(step=resume_step or 0, field=f"zo.{k}", old=recorded.hyperparameters[k], new=v)
               for k, v in mine.hyperparameters.items() if recorded.hyperparameters.get(k, v) != v]
    for change in changes:
        say(f"  {change.field} changed from {change.old:g} to {change.new:g} at step {change.step} (the step "
            "records carry it)")
    return Recording(storage, recorded.model_copy(update={
        "hyperparameters": mine.hyperparameters, "changes": [*recorded.changes, *changes]}) if changes else None)


def _describe(field: str, was, now) -> str:
    if isinstance(was, dict) and isinstance(now, dict):
        keys = sorted({k for k in {*was, *now} if was.get(k) != now.get(k)})
        return "; ".join(f"{field}.{k}={was.get(k)!r}, and this job has {field}.{k}={now.get(k)!r}" for k in keys)
    return f"{field} {was!r}, and this job has {field} {now!r}"


def _read(storage) -> RunIdentity | None:
    if not storage.exists(IDENTITY_FILE):
        return None
    try:
        return RunIdentity.model_validate_json(storage.read_bytes(IDENTITY_FILE))
    except ValueError as exc:
        raise JobConfigError(f"{storage.url_of(IDENTITY_FILE)} is not a run identity ({exc}); restore it from a "
                             "copy, or give this job another run_id or storage") from None


def _dump(identity: RunIdentity) -> bytes:
    return json.dumps(identity.model_dump(mode="json"), indent=2, sort_keys=True).encode()
