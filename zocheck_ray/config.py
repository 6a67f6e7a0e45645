"""`JobConfig`: one schema for a fine-tuning job, from YAML and `--set key=value` overrides.

    config = load_job_config("job.yaml", overrides=["zo.lr=1e-5", "task.batch_size=32"])

The start-up check (`control/startup.py`) then builds the task once, so a bad row fails,
naming its file and line, before any actor starts.
"""

from __future__ import annotations

import copy
import json
import os
import uuid
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from zocheck_ray.core.config import JobDtype, ZOConfig
from zocheck_ray.workload.peft_settings import PeftSettings
from zocheck_ray.workload.quantized.settings import QuantizationSettings
from zocheck_ray.workload.errors import WorkloadError
from zocheck_ray.workload.names import model_directory
from zocheck_ray.workload.task_config import TaskConfig


class JobConfigError(ValueError):
    """A job configuration that cannot run; the message names the field or file."""


MOVED_FIELDS = {
    "batch_size": "task.batch_size", "seq_len": "task.max_length", "data_seed": "task.data_seed",
    "shadow_cpus": "shadow.cpus", "shadow_nice": "shadow.nice", "snapshot_interval": "shadow.snapshot_interval",
    "max_lag_steps": "shadow.max_lag_steps", "recovery_snapshot": "shadow.recovery_snapshot",
    "durable_interval": "durability.durable_interval", "storage_share": "durability.storage_share",
    "max_undurable_steps": "durability.max_undurable_steps", "log_seal_records": "durability.log_seal_records",
    "lease_seconds": "durability.lease_seconds",
    "max_restarts": "failure.max_restarts", "standby": "failure.standby",
    "trainers": "scaling.trainers", "placement": "scaling.placement", "use_gpu": "scaling.use_gpu",
}
"""Fields an older job file may still carry, and where each setting lives now."""
REMOVED_FIELDS = {"process_template": "Ray starts every process itself; delete the line"}
"""Fields an older job file may still carry that no longer exist, and what to do."""


class ShadowSettings(BaseModel):
    """The shadow actor: its CPUs and priority, how often it snapshots, how far it may lag."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpus: int = Field(1, ge=1)
    """CPUs reserved for the shadow (its replay threads)."""
    nice: int = Field(19, ge=0, le=19)
    """Niceness of the shadow's replay and persistence threads (Linux), so the trainers run first on a busy node;
    0 leaves Ray's."""
    snapshot_interval: int | None = Field(None, ge=1)
    """Steps between shadow snapshots; None lets the startup profile choose."""
    max_lag_steps: int | None = Field(None, ge=1)
    """Resync the shadow from the trainer when it falls this many steps behind; None: the cost model's
    bound from the startup profile with `failure.mtbf_hours`, else 64."""
    recovery_snapshot: bool = True
    """Offer a trainer recovering on the CPU a fresh snapshot of the replica where that spares it replaying records
    and the memory is free; False: the newest image and the records after it."""


class DurabilitySettings(BaseModel):
    """What reaches durable storage and when: durable snapshots, the step log, the writer's lease."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    durable_interval: int | None = Field(None, ge=1)
    """Steps between durable snapshots, a multiple of `shadow.snapshot_interval` (the log is durable between
    them); None: the startup profile chooses (from `durability.storage_share`), or every snapshot."""
    storage_share: float = Field(0.1, gt=0, le=1)
    """The largest share of the run's time the shadow spends writing durable snapshots."""
    max_undurable_steps: int = Field(5000, ge=1)
    """Fail the run when this many steps are not in the durable log (storage down or too slow), beyond an object
    store's open segment; a warning comes at a tenth of it."""
    log_seal_records: int = Field(1024, ge=1)
    """Records per durable log segment; on S3 a segment is uploaded once full (or 60 s old), so a lost host may
    lose that many records, which the trainer recomputes."""
    lease_seconds: float = Field(30.0, gt=0)
    """How long the shadow's single-writer lease lives unrenewed; a second writer takes over only once it is
    stale."""


class FailureSettings(BaseModel):
    """How the run answers a lost process: Ray's restart budget and the warm standby."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_restarts: int = Field(10, ge=0)
    """How often Ray may restart the trainer or the shadow."""
    mtbf_hours: float | None = Field(None, gt=0)
    """Expected hours between failures, from which the cost model sets the lag bound and, where replay is
    slower than the trainer, the snapshot interval."""
    standby: bool = False
    """Keep a warm standby trainer beside rank 0, its model's skeleton built (on the CPU, one more copy of the
    state), to replace a lost trainer at once; the process Ray restarts becomes the next standby."""


class ScalingSettings(BaseModel):
    """How many trainer ranks, on which devices, placed where."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    trainers: int = Field(1, ge=1)
    """Data-parallel trainer ranks (one GPU or CPU each), bit-identical replicas; `task.batch_size` must divide
    among them. `{min: a, max: b}` (elastic; the result depends on `task.shards` only): go on with as few as a
    while ranks are lost; under `spread`, start once a can be placed and grow to b (under `pack`, start b)."""
    min_trainers: int | None = Field(None, ge=1)
    """The fewest ranks an elastic run trains with (set by `trainers: {min, max}`); None: a lost rank stops
    every rank until it is replaced."""
    placement: Literal["pack", "spread"] = "pack"
    """`pack`: every rank and the shadow on one node; `spread`: rank 0 with the shadow, the others anywhere."""
    collective_timeout_seconds: float = Field(600.0, gt=0)
    """How long a rank waits in an exchange or a rendezvous (gloo's timeout): above rank 0's longest evaluation,
    which the others wait out. A fixed group notices a silently lost node only after it."""
    use_gpu: Literal["auto", "yes", "no"] = "auto"
    """Train on a GPU: `auto` uses one when the cluster has one, `yes` requires one."""

    @model_validator(mode="before")
    @classmethod
    def _min_max(cls, data: Any) -> Any:
        """`trainers: {min: a, max: b}` (as Ray Train's `num_workers=(a, b)`) -> `trainers=b, min_trainers=a`."""
        if isinstance(data, dict) and isinstance(data.get("trainers"), dict):
            bounds = dict(data["trainers"])
            if set(bounds) != {"min", "max"} or not all(isinstance(v, int) for v in bounds.values()):
                raise ValueError(f"scaling.trainers={bounds} must be a number or {{min: a, max: b}} with whole a, b")
            if not 1 <= bounds["min"] <= bounds["max"]:
                raise ValueError(f"scaling.trainers: min={bounds['min']} must be at least 1 and at most "
                                 f"max={bounds['max']}")
            data = {**data, "trainers": bounds["max"], "min_trainers": bounds["min"]}
        return data

    @model_validator(mode="after")
    def _min_at_most_max(self) -> "ScalingSettings":
        if self.min_trainers is not None and self.min_trainers > self.trainers:
            raise ValueError(f"scaling.min_trainers={self.min_trainers} is more than scaling.trainers="
                             f"{self.trainers}: set scaling.trainers={{min: a, max: b}} with a <= b")
        return self

    @field_validator("use_gpu", mode="before")
    @classmethod
    def _yes_no(cls, value: Any) -> Any:
        # YAML 1.1 reads an unquoted yes/no (and on/off, true/false) as a boolean.
        return {True: "yes", False: "no"}.get(value, value) if isinstance(value, bool) else value


def retired_field(doc: Mapping[str, Any]) -> str | None:
    """The one line that refuses an older job file's field (`MOVED_FIELDS`, `REMOVED_FIELDS`), or None."""
    for old, new in MOVED_FIELDS.items():
        if old in doc:
            return f"{old} is no longer a job field: set {new} (one place for each setting)"
    for old, why in REMOVED_FIELDS.items():
        if old in doc:
            return f"{old} is no longer a job field: {why}"
    return None


class JobConfig(BaseModel):
    """A ZO fine-tuning job run by the trainer and shadow actors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = Field(default_factory=lambda: "run-" + uuid.uuid4().hex[:8])
    """Names the run's actors, directory under `storage` and metrics: letters, digits, '-', '_' and '.', not
    starting with '.'."""
    model: str = "tiny-opt"
    """A built-in small model built from its config (tiny-opt, tiny-llama, tiny-qwen3, tiny-bert), a packaged
    one (minilm), or a Hugging Face model directory saved with `save_pretrained`."""
    dtype: JobDtype = "fp32"
    """Parameter dtype."""
    zo: ZOConfig = ZOConfig(lr=2e-3, eps=1e-3)
    """The zeroth-order optimizer (`zo.optimizer`, `zo.lr`, `zo.eps`, ...)."""
    peft: PeftSettings | None = None
    """Train a `peft` adapter only (`peft.method`: lora or prefix), or a quantized base's scales (qzo), so the
    snapshots hold the adapter alone; None trains every parameter."""
    quantization: QuantizationSettings | None = None
    """Load the frozen base quantized (`quantization.backend`: bitsandbytes, torchao or quanto) from a model
    directory, under `peft` (docs/quantized.md); None: the base in `dtype`."""
    task: TaskConfig = TaskConfig()
    """What the model is fine-tuned on (`task.kind`, `task.data_path`, `task.batch_size`, ...)."""
    steps: int = Field(200, ge=1)
    """Training steps to run."""
    run_seed: int = Field(0, ge=0)
    """Initial weights and the perturbation seed of step t are pure functions of (run_seed, t);
    the batch of step t is a function of (`task.data_seed`, t)."""
    storage: str = "./runs"
    """Root URL for durable state (local path, file:// or s3://BUCKET[/PREFIX]); the run writes under
    <storage>/<run_id>. A job submitted with `ray job submit` needs an absolute path or s3://."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """fsspec options for `storage` (e.g. endpoint_url); credentials are never logged."""
    shadow: ShadowSettings = ShadowSettings()
    """The shadow (`shadow.cpus`, `shadow.snapshot_interval`, `shadow.max_lag_steps`, ...)."""
    durability: DurabilitySettings = DurabilitySettings()
    """Durable snapshots, the step log and the lease (`durability.durable_interval`, ...)."""
    failure: FailureSettings = FailureSettings()
    """Restarts and the warm standby (`failure.max_restarts`, `failure.standby`)."""
    scaling: ScalingSettings = ScalingSettings()
    """Data-parallel ranks and their placement (`scaling.trainers`, `scaling.placement`, `scaling.use_gpu`)."""
    log_interval: int = Field(10, ge=1)
    """Steps between progress lines (and metric polls)."""
    hash_every_step: bool = False
    """Record the trainer's `state_hash` after every step (for verification; costs a hash per step)."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and (line := retired_field(data)) is not None:
            raise ValueError(line)
        return data

    @model_validator(mode="after")
    def _durable_interval(self) -> "JobConfig":
        durable, snapshot = self.durability.durable_interval, self.shadow.snapshot_interval
        if durable is not None and snapshot is not None and durable % snapshot:
            raise ValueError(f"durability.durable_interval={durable} is not a multiple of shadow.snapshot_interval="
                             f"{snapshot}: a durable snapshot is one of the shadow's snapshots")
        return self

    @model_validator(mode="after")
    def _quantized_base(self) -> "JobConfig":
        qzo = self.peft is not None and self.peft.method == "qzo"
        if self.quantization is None:
            if qzo:
                raise ValueError("peft.method=qzo trains the scales of a quantized base: set quantization.backend "
                                 "(bitsandbytes, torchao or quanto)")
            return self
        if self.peft is None:
            raise ValueError("quantization: a quantized base stays frozen, and without peft every weight would be "
                             "trained; set peft.method (lora, prefix, or qzo for the scales)")
        if model_directory(self.model) is None:
            raise ValueError(f"quantization loads the model with from_pretrained, and model {self.model!r} is not "
                             "a model directory; save it with save_pretrained and name the directory")
        if qzo and self.zo.weight_decay:
            raise ValueError(f"zo.weight_decay={self.zo.weight_decay} with peft.method=qzo: QZO never decays the "
                             "scales; set zo.weight_decay=0")
        if qzo and self.quantization.double_quant:
            raise ValueError("peft.method=qzo trains the scales, which quantization.double_quant=true quantizes; "
                             "set quantization.double_quant=false")
        return self

    @model_validator(mode="after")
    def _batch_divides(self) -> "JobConfig":
        shards, k = self.task.shards, self.scaling.trainers
        if shards is not None and self.task.batch_size % shards:
            raise ValueError(f"task.batch_size={self.task.batch_size} does not divide into task.shards={shards} "
                             "equal shards: make task.batch_size a multiple of task.shards")
        if shards is not None and shards < k:
            raise ValueError(f"task.shards={shards} is fewer than scaling.trainers={k}: every rank holds at least "
                             "one shard; raise task.shards or lower scaling.trainers")
        if shards is None and self.task.batch_size % self.scaling.trainers:
            raise ValueError(f"task.batch_size={self.task.batch_size} does not divide among scaling.trainers="
                             f"{self.scaling.trainers} ranks: every rank evaluates an equal slice of the batch; "
                             "make task.batch_size a multiple of scaling.trainers")
        return self

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
        check_run_id(value)
        return value

    @field_validator("storage")
    @classmethod
    def _storage(cls, value: str) -> str:
        check_storage_url(value)
        return value

    @property
    def run_url(self) -> str:
        return join_run_url(self.storage, self.run_id)


RUN_ID_CHARS = "letters, digits, '-', '_' and '.'"
MAX_RUN_ID_LENGTH = 128


def check_run_id(value: str) -> None:
    """Raise `ValueError` unless `value` is a plain name (`RUN_ID_CHARS`, not starting with '.'): it becomes a
    directory under `storage`."""
    shown = repr(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"run_id must be a non-empty plain name ({RUN_ID_CHARS}), got {shown}")
    if not all((c.isascii() and c.isalnum()) or c in "-_." for c in value):
        raise ValueError(f"run_id {shown} must be a plain name of {RUN_ID_CHARS} only (no '/', '\\', spaces or "
                         "control characters): it names the run's directory under storage")
    if value.startswith("."):
        raise ValueError(f"run_id {shown} must not start with '.' ('.' and '..' name the storage root or its "
                         "parent, not a run of its own); e.g. run_id=sst2-1")
    if len(value) > MAX_RUN_ID_LENGTH:
        raise ValueError(f"run_id {value[:20]!r}... is {len(value)} characters; at most {MAX_RUN_ID_LENGTH}")


def check_storage_url(value: str) -> None:
    """Raise `ValueError` unless `value` is a storage root a job can use (no I/O: syntax only)."""
    from zocheck_ray.storage.fs import parse_url, redact
    from zocheck_ray.storage.errors import StorageURLError

    try:
        scheme, _ = parse_url(value)
    except StorageURLError as exc:
        raise ValueError(str(exc)) from None
    if scheme == "memory":
        raise ValueError(f"storage {redact(value)}: memory:// lives inside one process, and a job's trainer and "
                         "shadow are separate processes; use a path shared by both or s3://")


def with_absolute_paths(job: JobConfig) -> JobConfig:
    """`job` with its relative local paths (storage, a model directory, data files) made absolute here: the run's
    actors, and Tune's trials, work in other directories."""
    doc = job.model_dump(mode="json")
    if "://" not in doc["storage"]:
        doc["storage"] = os.path.abspath(os.path.expanduser(doc["storage"]))
    if Path(doc["model"]).is_dir():
        doc["model"] = os.path.abspath(doc["model"])
    for key in ("data_path", "eval_path"):
        if doc["task"].get(key) and Path(doc["task"][key]).exists():
            doc["task"][key] = os.path.abspath(doc["task"][key])
    return job if doc == job.model_dump(mode="json") else JobConfig.model_validate(doc)


def join_run_url(storage: str, run_id: str) -> str:
    """`<storage>/<run_id>`, keeping the storage URL's own slashes (`s3://b/` + `r` = `s3://b/r`)."""
    return storage + ("" if storage.endswith("/") else "/") + run_id


RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray's job supervisor (Ray 2.60, `job_supervisor.py`) for a `ray job submit` entrypoint:
JSON with the job's runtime env and `metadata.job_submission_id`."""


def submitted_job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The submission id when this process is a `ray job submit` entrypoint, else None."""
    env = os.environ if environ is None else environ
    raw = env.get(RAY_JOB_ENV)
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return "unknown"
    metadata = doc.get("metadata") if isinstance(doc, dict) else None
    return str((metadata or {}).get("job_submission_id") or "unknown")


def check_job_environment(job: JobConfig, environ: Mapping[str, str] | None = None) -> None:
    """Raise `JobConfigError`, before Ray starts, for what only goes wrong where the job runs: under `ray job
    submit` a relative local `storage` lands in Ray's temporary copy of the working directory and vanishes."""
    submission = submitted_job_id(environ)
    if submission is None or "://" in job.storage:
        return
    if not os.path.isabs(os.path.expanduser(job.storage)):
        raise JobConfigError(
            f"storage={job.storage!r} is a relative path, and this job (submission {submission}) runs in Ray's "
            f"temporary copy of its working directory, where the run's snapshots and log would be deleted with "
            f"the cluster's temporary files: set an absolute path on storage every node shares "
            f"(--storage /shared/zocheck-runs) or s3://BUCKET/PREFIX")


def _set(doc: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = doc
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise JobConfigError(f"--set {dotted}: {key!r} is not a section")
    node[keys[-1]] = value


def _section(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class that holds the field at `loc` (a section of `model`), or None past a plain field."""
    for key in loc[:-1]:
        field = model.model_fields.get(key) if isinstance(key, str) else None
        kinds = [t for t in getattr(field.annotation, "__args__", (field.annotation,)) if isinstance(t, type)
                 and issubclass(t, BaseModel)] if field is not None else []
        if not kinds:
            return None
        model = kinds[0]
    return model


def describe_error(error: dict, model: type[BaseModel]) -> str:
    """One pydantic error as one line: the field's dotted path, what it accepts, the nearest valid name."""
    import difflib

    loc = tuple(k for k in error["loc"] if not (isinstance(k, str) and k.startswith("function-")))
    path, kind, value = ".".join(str(k) for k in loc), error["type"], error.get("input")
    message = error["msg"].removeprefix("Value error, ").removeprefix("Input should be ")
    if kind == "extra_forbidden":
        section = _section(model, loc)
        fields = sorted(section.model_fields) if section is not None else []
        owner = ".".join(str(k) for k in loc[:-1]) or "the job"
        near = difflib.get_close_matches(str(loc[-1]), fields, n=1)
        hint = f"; did you mean {'.'.join([*map(str, loc[:-1]), near[0]])}?" if near else ""
        return f"{path} is not a field of {owner}{hint} ({owner}'s fields: {', '.join(fields)})"
    if kind == "missing":
        return f"{path} is required"
    if kind == "value_error" or not loc:
        return message if not loc or message.startswith(path) else f"{path}: {message}"
    if isinstance(value, float) and value != value:
        return f"{path}=nan is not a number: give a finite value"
    if kind == "string_type" and isinstance(value, (int, float, bool)):
        return f"{path}={value!r} must be a string: quote it, e.g. --set '{path}=\"{value}\"' or {path}: \"{value}\""
    if kind.endswith("_type") and isinstance(value, (dict, list)) is False and _section(model, (*loc, "")):
        return f"{path}={value!r} must be a section of fields ({path}.FIELD=VALUE)"
    shown = value if isinstance(value, (int, float, bool, str)) or value is None else type(value).__name__
    return f"{path}={shown!r} must be {message}" if kind == "literal_error" else f"{path}={shown!r}: should be {message}"


def describe_errors(exc: ValidationError, model: type[BaseModel]) -> str:
    """Every error of `exc` on one line (see `describe_error`), so the user reads the fix, not pydantic's report."""
    return "; ".join(describe_error(e, model) for e in exc.errors())


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
        if loaded is None:
            # An empty file must not silently become the default job.
            raise JobConfigError(f"config file {path} is empty: write the job's fields in it (see "
                                 "`zocheck-ray config-reference`), or leave out --config to run the embedded default")
        if not isinstance(loaded, dict):
            raise JobConfigError(f"config file {path} must hold a mapping of job fields (key: value lines), "
                                 f"not a {type(loaded).__name__}")
        doc = loaded
    for item in overrides or []:
        if "=" not in item:
            raise JobConfigError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        if not key.strip() or "" in key.strip().split("."):
            raise JobConfigError(f"--set {item!r}: the field before '=' is blank; e.g. --set zo.lr=1e-4")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise JobConfigError(f"--set {item!r}: the value is not valid YAML ({exc.__class__.__name__}); "
                                 "quote it, e.g. --set 'run_id=\"my-run\"'") from exc
        _set(doc, key.strip(), value)
    for key, value in fields.items():
        if value is not None:
            _set(doc, key, value)
    if (line := retired_field(doc)) is not None:  # one line, not pydantic's report
        raise JobConfigError(line)
    try:
        job = JobConfig.model_validate(doc)
    except ValidationError as exc:
        where = f" in {path}" if path is not None else ""
        raise JobConfigError(f"invalid job configuration{where}: {describe_errors(exc, JobConfig)}") from None
    return job
