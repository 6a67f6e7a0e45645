"""`JobConfig`: one schema for a fine-tuning job, from YAML and `--set key=value` overrides.

    config = load_job_config("job.yaml", overrides=["zo.lr=1e-5", "steps=500"])
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from zocheck_ray.core.config import ZOConfig
from zocheck_ray.workload.models import SMALL_MODELS


class JobConfigError(ValueError):
    """A job configuration that cannot run; the message names the field or file."""


class FaultInjection(BaseModel):
    """Faults a test or a demonstration injects on purpose."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replay_delay_seconds: float = Field(0.0, ge=0)
    """Extra seconds the shadow spends per replayed step (makes it lag)."""
    crash_in_recovery_marker: str | None = None
    """A file path: the first recovering trainer that finds it missing creates it and dies mid-recovery."""


class JobConfig(BaseModel):
    """A ZO fine-tuning job run by the trainer and shadow actors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = Field(default_factory=lambda: "run-" + uuid.uuid4().hex[:8])
    """Names the run: its actors, its directory under `storage`, its metrics."""
    model: str = "tiny-opt"
    """A built-in small model (tiny-opt, tiny-llama, tiny-qwen3) or a saved Hugging Face model directory."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Parameter dtype."""
    zo: ZOConfig = ZOConfig(lr=2e-3, eps=1e-3)
    """The zeroth-order optimizer."""
    steps: int = Field(200, ge=1)
    """Training steps to run."""
    batch_size: int = Field(4, ge=1)
    """Sequences per step."""
    seq_len: int = Field(24, ge=2)
    """Tokens per sequence."""
    run_seed: int = Field(0, ge=0)
    """The seed of step t is a pure function of (run_seed, t)."""
    data_seed: int = Field(0, ge=0)
    """The batch of step t is a pure function of (data_seed, t)."""
    storage: str = "./runs"
    """Root URL for durable state (local path, file:// or s3://); the run writes under <storage>/<run_id>."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """fsspec options for `storage` (e.g. endpoint_url); credentials are never logged."""
    snapshot_interval: int | None = Field(None, ge=1)
    """Steps between shadow snapshots; None lets the startup profile choose."""
    shadow_cpus: int = Field(1, ge=1)
    """CPUs reserved for the shadow (its replay threads)."""
    max_lag_steps: int = Field(64, ge=1)
    """Resync the shadow from the trainer when it falls this many steps behind."""
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
    faults: "FaultInjection" = Field(default_factory=lambda: FaultInjection())
    """Fault injection for tests and demonstrations."""

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        if value not in SMALL_MODELS and not Path(value).is_dir():
            raise ValueError(f"model {value!r} is neither a built-in small model {sorted(SMALL_MODELS)} "
                             "nor an existing directory")
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
                    **fields: Any) -> JobConfig:
    """Read YAML (safe_load), apply `key=value` overrides (values parsed as YAML), then `fields`."""
    doc: dict = {}
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
        return JobConfig.model_validate(doc)
    except ValidationError as exc:
        where = f" in {path}" if path is not None else ""
        raise JobConfigError(f"invalid job configuration{where}:\n{exc}") from exc
