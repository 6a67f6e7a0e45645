"""`JobConfig`: one schema for a fine-tuning job, from YAML and `--set key=value` overrides.

    config = load_job_config("job.yaml", overrides=["zo.lr=1e-5", "task.batch_size=32"])

`load_job_config` also builds the task once (reads every data row, checks the labels
and the model's fit), so bad input fails with a `JobConfigError` naming the field or
file before any actor starts.
"""

from __future__ import annotations

import copy
import uuid
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from zocheck_ray.core.config import ZOConfig
from zocheck_ray.workload.errors import WorkloadError
from zocheck_ray.workload.models import model_directory
from zocheck_ray.workload.task_config import TaskConfig


class JobConfigError(ValueError):
    """A job configuration that cannot run; the message names the field or file."""


MOVED_FIELDS = {"batch_size": "task.batch_size", "seq_len": "task.max_length", "data_seed": "task.data_seed"}
"""Fields an older job file may still carry, and where each setting lives now."""


class JobConfig(BaseModel):
    """A ZO fine-tuning job run by the trainer and shadow actors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = Field(default_factory=lambda: "run-" + uuid.uuid4().hex[:8])
    """Names the run: its actors, its directory under `storage`, its metrics."""
    model: str = "tiny-opt"
    """A built-in small model built from its config (tiny-opt, tiny-llama, tiny-qwen3, tiny-bert), a packaged
    one (minilm), or a Hugging Face model directory saved with `save_pretrained`."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Parameter dtype."""
    zo: ZOConfig = ZOConfig(lr=2e-3, eps=1e-3)
    """The zeroth-order optimizer (`zo.optimizer`, `zo.lr`, `zo.eps`, ...)."""
    task: TaskConfig = TaskConfig()
    """What the model is fine-tuned on: data files, prompt, batch size, sequence length, evaluation
    (`task.kind`, `task.data_path`, `task.batch_size`, `task.max_length`, `task.eval_interval`, ...)."""
    steps: int = Field(200, ge=1)
    """Training steps to run."""
    run_seed: int = Field(0, ge=0)
    """Initial weights and the perturbation seed of step t are pure functions of (run_seed, t);
    the batch of step t is a function of (`task.data_seed`, t)."""
    storage: str = "./runs"
    """Root URL for durable state (local path, file:// or s3://); the run writes under <storage>/<run_id>."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """fsspec options for `storage` (e.g. endpoint_url); credentials are never logged."""
    snapshot_interval: int | None = Field(None, ge=1)
    """Steps between shadow snapshots; None lets the startup profile choose."""
    shadow_cpus: int = Field(1, ge=1)
    """CPUs reserved for the shadow (its replay threads)."""
    max_lag_steps: int | None = Field(None, ge=1)
    """Resync the shadow from the trainer when it falls this many steps behind; None: the cost model's
    bound from the startup profile (64 without one)."""
    max_undurable_steps: int = Field(5000, ge=1)
    """Fail the run when this many of the trainer's steps are not durable in the step log (storage down
    or too slow); a warning comes at a tenth of it. A node lost now would recompute that many steps."""
    use_gpu: Literal["auto", "yes", "no"] = "auto"
    """Train on a GPU: `auto` uses one when the cluster has one, `yes` requires one."""
    log_interval: int = Field(10, ge=1)
    """Steps between progress lines (and metric polls)."""
    max_restarts: int = Field(10, ge=0)
    """How often Ray may restart the trainer or the shadow."""
    log_seal_records: int = Field(1024, ge=1)
    """Records per durable log segment."""
    hash_every_step: bool = False
    """Record the trainer's `state_hash` after every step (for verification; costs a hash per step)."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in MOVED_FIELDS.items():
                if old in data:
                    raise ValueError(f"{old} is no longer a job field: set {new} (one place for each setting)")
        return data

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        try:
            model_directory(value)
        except WorkloadError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str) -> str:
        if not value or not all(c.isalnum() or c in "-_." for c in value):
            raise ValueError(f"run_id {value!r} may hold letters, digits, '-', '_' and '.' only")
        return value

    @property
    def run_url(self) -> str:
        return self.storage.rstrip("/") + "/" + self.run_id


def _set(doc: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = doc
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise JobConfigError(f"--set {dotted}: {key!r} is not a section")
    node[keys[-1]] = value


def load_job_config(path: str | Path | None = None, overrides: list[str] | None = None,
                    base: dict | None = None, **fields: Any) -> JobConfig:
    """Read YAML (safe_load), apply `key=value` overrides (values parsed as YAML), then `fields`.

    `base`: the document to start from when there is no `path` (the embedded default job).
    """
    doc: dict = copy.deepcopy(base or {})
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise JobConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise JobConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise JobConfigError(f"config file {path} must hold a mapping, not {type(loaded).__name__}")
        doc = loaded or {}
    for item in overrides or []:
        if "=" not in item:
            raise JobConfigError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        _set(doc, key.strip(), yaml.safe_load(raw))
    for key, value in fields.items():
        if value is not None:
            _set(doc, key, value)
    try:
        job = JobConfig.model_validate(doc)
    except ValidationError as exc:
        where = f" in {path}" if path is not None else ""
        raise JobConfigError(f"invalid job configuration{where}:\n{exc}") from exc
    check_task(job)
    return job


def check_task(job: JobConfig):
    """Build `job`'s task for `job.model`: every data row read, labels and the model's fit checked.

    Returns the task (see `zocheck_ray.workload.build_task`); raises `JobConfigError`
    naming the field or the file and line, before any model or actor exists.
    """
    from zocheck_ray.workload.tasks import build_task

    try:
        return build_task(job.task, job.model)
    except WorkloadError as exc:
        raise JobConfigError(f"task ({job.task.kind} on model {job.model!r}): {exc}") from exc
