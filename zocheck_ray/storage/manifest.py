"""The snapshot manifest: the commit marker and table of contents of a snapshot directory.

It lists every tensor in canonical order, every file's SHA-256 and size, the `state_hash` and the ZO
config, and carries a SHA-256 of its own canonical JSON, so a damaged one is never taken for a commit.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from zocheck_ray.storage.errors import CorruptSnapshotError

FORMAT = "zocheck-ray snapshot"


class SnapshotMeta(BaseModel):
    """What a snapshot carries besides its tensors; returned by `load` as it was saved."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str | None = None
    """Identifies the training run the snapshot belongs to."""
    zo_config: dict[str, Any] | None = None
    """The ZO optimizer config (`ZOConfig.model_dump(mode="json")`): how to replay the log onto it."""
    hf_config: dict[str, Any] | None = None
    """A Hugging Face model config, written as `config.json` so `from_pretrained` loads the directory."""
    adapter_config: dict[str, Any] | None = None
    """A peft adapter config, written as `adapter_config.json`; the parameters then go to
    `adapter_model.safetensors`."""
    user: dict[str, Any] = Field(default_factory=dict)
    """Any other JSON metadata."""
    text_files: dict[str, str] = Field(default_factory=dict)
    """Other files by name (a byte-level run's tokenizer), written and hashed with the tensors."""

    @field_validator("zo_config", "hf_config", mode="before")
    @classmethod
    def _dump_models(cls, value):
        if isinstance(value, BaseModel):
            return value.model_dump(mode="json")
        if hasattr(value, "to_dict") and callable(value.to_dict):  # a transformers PretrainedConfig
            return value.to_dict()
        return value


class TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    file: str
    dtype: str
    shape: list[int]
    nbytes: int


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    sha256: str
    size: int


class Manifest(BaseModel):
    """The commit marker of a snapshot: what it holds, in canonical order, and every file's hash."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["zocheck-ray snapshot"] = FORMAT
    version: Literal[1] = 1
    step: int = Field(ge=0)
    run_id: str | None = None
    created_unix: float
    state_hash: str
    """`zocheck_ray.core.state_hash` of the tensors in canonical order."""
    tensors: list[TensorEntry]
    files: dict[str, FileEntry]
    zo_config: dict[str, Any] | None = None
    user: dict[str, Any] = Field(default_factory=dict)
    rules_version: int = Field(1, ge=1)
    """`core.record.RULES_VERSION` of the run (absent before version 2)."""
    held: bool = False
    """Saved with `hold`: retention keeps it until `retention.json` releases or pins it."""
    log_first_step: int | None = Field(None, ge=0)
    log_last_step: int | None = Field(None, ge=0)
    """The records of steps `log_first_step..log_last_step` were durable in the run's log when this snapshot was
    committed, so `audit_run` fails where they are missing; None: nothing promised."""

    def encode(self) -> bytes:
        body = self.model_dump(mode="json")
        body["manifest_sha256"] = hashlib.sha256(_canonical(self.model_dump(mode="json"))).hexdigest()
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, url: str) -> "Manifest":
        try:
            body = json.loads(data)
            claimed = body.pop("manifest_sha256")
            manifest = cls.model_validate(body)
        except (ValueError, KeyError, TypeError, AttributeError, ValidationError) as exc:
            raise CorruptSnapshotError(f"{url} does not parse as a snapshot manifest: {exc}", url) from exc
        if hashlib.sha256(_canonical(body)).hexdigest() != claimed:
            raise CorruptSnapshotError(f"{url} fails its own checksum (manifest_sha256)", url)
        return manifest

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files.values())


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
