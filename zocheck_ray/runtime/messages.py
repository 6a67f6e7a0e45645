"""Messages that cross a process between the trainers, the shadow and the controller.

Frozen models, so a renamed field fails at import, not deep into a run. None is stored.

    trainer -> controller   TrainerProgress (a segment's end), RecoveryInfo (a restore)
    shadow  -> controller   ShadowMetrics (also `zocheck-ray status` and the gauges)
    controller -> shadow    TrainerTimes (the ranks' step times, for `status`)
    shadow  -> trainer      PushReply (every push), RecoveryOffer (an image to restore from)
"""

from __future__ import annotations

import enum
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from zocheck_ray.host.handle import ImageHandle

_FROZEN = ConfigDict(extra="forbid", frozen=True)


class PushReply(NamedTuple):
    """The shadow's answer to every push (and ping): what it holds."""

    incarnation: str
    """Which shadow process answered (a new one restarted and may lack records)."""
    next_step: int
    """The step of the next record it expects."""
    durable_next: int
    """Every record before this step is durable in the step log."""
    accepted: int


class AdapterIdentity(BaseModel):
    """A parameter-efficient run's base and adapter, recorded beside the adapter's state."""

    model_config = _FROZEN

    base_hash: str
    """SHA-256 of the frozen base model's weights."""
    adapter_config: dict
    """The peft adapter config, as `adapter_config.json` holds it."""


class RecoveryOffer(BaseModel):
    """What a shadow offers a recovering trainer: its newest image (lent) and the records after it."""

    model_config = _FROZEN

    image: ImageHandle
    """Given back when read."""
    records: bytes
    """The encoded records after the image's step."""
    source: str
    """Where the shadow's replica came from: `fresh`, `durable` or `resync`."""
    adapter: AdapterIdentity | None = None
    """None: full fine-tuning."""


class PublisherStats(BaseModel):
    """The trainer's publishing of records to the shadow."""

    model_config = _FROZEN

    held_records: int
    """Records sent, not yet known durable (kept for a restarted shadow)."""
    resent_records: int
    """Records sent again because a restarted shadow lacked them."""
    delivered_records: int
    """Records a data-parallel rank handed the shadow after a lost rank."""
    shadow_restarts_seen: int
    """New shadow incarnations seen in push replies."""
    publish_errors: int
    """Pushes that failed; what they carried is sent again."""
    last_publish_error: str | None
    gap: str | None
    """Records the shadow lacks that no trainer holds any more (a resync repairs it)."""


class KernelCheckInfo(BaseModel):
    """The start-up guard's verdict on the GPU kernels."""

    model_config = _FROZEN

    backend: str
    """`triton` when the kernels passed and are used, `eager` otherwise."""
    passed: bool | None
    """Whether the kernels gave the oracle's bits; None: not checked."""
    device: str
    dtypes: list[str] = []
    mismatches: list[str] = []
    """What differed (or the error), one line each."""
    reason: str = ""
    seconds: float = 0.0
    checks: int = 0
    """Tensors compared."""


class KernelInfo(BaseModel):
    """Which implementation updates the weights, and the guard's verdict on CUDA."""

    model_config = _FROZEN

    device: str
    """`cpu` or `cuda`."""
    backend: str
    """`fused`/`eager` on the CPU, `triton` or `eager` on CUDA."""
    check: KernelCheckInfo | None = None
    """CUDA only."""


class TrainerProgress(BaseModel):
    """A trainer rank's report at the end of a segment of steps."""

    model_config = _FROZEN

    step: int
    """The next step it will run."""
    loss: float | None
    """The training loss of its last step (at +eps)."""
    rank: int
    step_hashes: dict[int, str] = {}
    """With `hash_every_step`: the state_hash after each step of the segment."""
    step_seconds: list[float] = []
    """Each step's wall time."""
    collective_seconds: list[float] = []
    """Data parallel: each step's all-gather time."""
    interrupted: int | None = None
    """Data parallel: the step a failed gather interrupted (the state is torn)."""
    regroups: list[tuple[int, float, float]] = []
    """Elastic: (step, stall seconds, of them waiting for the controller's plan) of each group formed mid-step."""
    evaluations: dict[int, dict[str, float]] = {}
    """Held-out metrics by step."""
    samples: dict[int, list[tuple[str, str]]] = {}
    """Kind `sft`: each evaluation's greedy (prompt, text) pairs, by step."""
    eval_seconds: float = 0.0
    publish_us_median: float | None = None
    """Median cost of publishing one record, on the training loop's path."""
    publisher: PublisherStats
    kernel: KernelInfo


StandbyState = Literal["none", "starting", "ready"]
"""The warm standby as `status` reports it."""


class Role(str, enum.Enum):
    """A trainer process's role; `runtime.trainer.TRANSITIONS` holds the moves."""

    WAITING = "waiting"
    """No rank yet: a standby, or a process Ray restarted."""
    RESTORING = "restoring"
    """Copying an image in and replaying its records."""
    RANK = "rank"
    """Training as its rank."""
    TORN = "torn"
    """A gather failed mid-perturbation: no usable state until `rejoin`."""


class RecoveryInfo(BaseModel):
    """How a trainer process came to its state."""

    model_config = _FROZEN

    incarnation: str
    """Which process (a new one after Ray restarts it)."""
    step: int | None
    """The step it is at (None while it waits)."""
    source: str
    """`fresh`, `memory` (the shadow's image), `durable` (storage), `kept` (a data-parallel survivor) or
    `deferred`."""
    role: Role = Role.RANK
    image_step: int | None = None
    replayed_records: int = 0
    state_hash: str | None = None
    """With `hash_every_step`."""
    state_bytes: int | None = None
    seconds: float | None = None
    """The process's set-up, or the restore when told to restore later."""
    build_seconds: float | None = None
    """Building the model (a skeleton when it restores)."""
    restore_seconds: float | None = None
    """fetch + install + replay."""
    fetch_seconds: float | None = None
    """Asking the shadow for its image and opening it."""
    install_seconds: float | None = None
    """Checking, copying and giving back the image."""
    copy_seconds: float | None = None
    """The copy within `install_seconds`; None where `preinstalled`."""
    copy_threads: int | None = None
    read_through: str | None = None
    """`memfd` (opened on the shadow's node), `ray` (windows through Ray) or `process`."""
    preinstalled: bool = False
    """The image was in the state already (a CPU standby copies each new one)."""
    replay_seconds: float | None = None
    replay_threads: int | None = None
    """None: no CPU replay."""
    hash_seconds: float | None = None


class TrainerTimes(BaseModel):
    """The ranks' step times over the controller's last segment, for `status`."""

    model_config = _FROZEN

    rank_seconds_per_step: list[float]
    collective_seconds_per_step: float | None = None
    held_out_step: int | None = None
    held_out: dict[str, float] = {}
    standby: StandbyState = "none"
    ranks: int = 1
    rank_shards: list[list[int]] = []
    group_changes: int = 0
    last_group_change: str | None = None


class ShadowStatus(BaseModel):
    """What the controller decides on after each segment: progress, lag, durability and the stages' errors."""

    model_config = _FROZEN

    run_id: str
    """The run."""
    incarnation: str
    """Which shadow process answers (a new one after a restart)."""
    trainer_step: int
    """The trainer's next step, as it last reported it."""
    received_step: int
    """Records accepted, in order (the next step expected)."""
    replayed_step: int
    """The replica is at this step."""
    lag_steps: int
    """trainer_step - replayed_step."""
    replay_seconds_per_step: float
    """Recent replay time per step (moving average)."""
    snapshot_interval: int
    """N: steps between snapshots."""
    snapshot_step: int | None
    """Step of the newest in-memory image."""
    durable_step: int | None
    """Step of the newest committed durable snapshot."""
    durable_log_step: int | None
    """Last step whose record is durable in the step log."""
    undurable_steps: int
    """Steps a lost node would recompute."""
    persist_in_flight: bool
    """A snapshot write is in progress (one at a time)."""
    persist_failures: int
    """Failed writes of the log or a snapshot (each retried)."""
    persist_stopped: bool = False
    """Persistence stopped for good (`persist_stop_reason` says why)."""
    persist_stop_reason: Literal["writer_lost", "storage_lost", "storage_refused"] | None = None
    """`writer_lost`: another writer took over the run's storage; `storage_lost`: what was durable is gone from its
    path; `storage_refused`: the store refuses every write."""
    durable_interval: int | None = None
    """D: images at multiples of this step are made durable (None without persistence)."""
    replay_error: str | None = None
    """The replay stage stopped on it until a resync repairs the replica."""
    persist_error: str | None = None
    """The storage's last error, with its path; cleared once every failed part has written again."""


class ShadowStats(BaseModel):
    """What `status`, the summary and the gauges add to the status: costs, memory, counters."""

    model_config = _FROZEN

    lag_seconds: float
    """lag_steps times the replay time per step."""
    last_persist_seconds: float | None
    """The last snapshot write, log flush included."""
    snapshots_taken: int
    """In-memory snapshots of the replica."""
    snapshots_persisted: int
    """Snapshots committed to durable storage."""
    resync_count: int
    """Resets of the replica from the trainer's state (lag above `shadow.max_lag_steps`)."""
    rejected_records: int
    """Records refused as from the past or the future."""
    persist_failing_seconds: float
    """How long persistence has failed without a success."""
    ingest_error: str | None = None
    """The last damaged push."""
    state_bytes: int = 0
    """The state's tensors, without alignment."""
    replica_bytes: int = 0
    """One copy of the state."""
    image_bytes: int = 0
    """One copy of the state."""
    scratch_bytes: int = 0
    """The startup profile's scratch copy (none after it)."""
    held_bytes: int = 0
    """replica + image + scratch."""
    peak_held_bytes: int = 0
    """By design 2x `state_bytes` plus the scratch."""
    baseline_bytes: int | None = None
    """Resident memory before any state arrived."""
    snapshots_deferred: int = 0
    """Snapshot boundaries skipped while the image was persisted."""
    recovery_snapshots: int = 0
    """For a recovering trainer (`shadow.recovery_snapshot`)."""
    snapshot_seconds: float | None = None
    """The last copy between the replica and an image."""
    snapshot_into_fresh_memory: bool | None = None
    """Whether that copy wrote into newly allocated memory."""
    snapshot_threads: int | None = None
    """The threads of that copy."""
    snapshot_seconds_median: float | None = None
    """Over the newest (up to 32) copies into memory in use."""
    snapshot_error: str | None = None
    """Why the last snapshot could not be taken."""
    rank_seconds_per_step: list[float] = []
    """Each rank's mean step time over the last segment."""
    collective_seconds_per_step: float | None = None
    """Data parallel: the all-gather per step, waits included."""
    held_out_step: int | None = None
    """The step of the newest held-out evaluation."""
    held_out: dict[str, float] = {}
    """Its metrics (`accuracy`, `f1`, `loss`, ...; `dev_loss`, ... with dev rows)."""
    best_dev_step: int | None = None
    """With dev rows (`task.num_dev`): the step of the lowest `dev_loss` so far, after step 0."""
    best_dev_loss: float | None = None
    """Its `dev_loss`."""
    best_dev_snapshot: str | None = None
    """Its durable snapshot, pinned against retention (None until committed): a `from_pretrained` directory."""
    standby: StandbyState = "none"
    """The warm standby: `none`, `starting` or `ready`."""
    ranks: int = 1
    """The data-parallel ranks training now."""
    rank_shards: list[list[int]] = []
    """Each rank's shards of the batch (`task.shards`)."""
    group_changes: int = 0
    """Times an elastic group went on without a lost rank or took one back."""
    last_group_change: str | None = None
    """The newest of them: kind, step, ranks, cause and the others' stall."""
    regime: Literal["keep-pace", "lag", "unknown"]
    """The cost model's regime (`unknown`: no profile yet)."""
    source: str
    """Where the replica came from: fresh, durable, resync."""


class ShadowMetrics(ShadowStats, ShadowStatus):
    """The status and the stats together, flat: what `status` prints, the gauges export and a summary keeps."""

    @property
    def status(self) -> ShadowStatus:
        return ShadowStatus(**{n: getattr(self, n) for n in ShadowStatus.model_fields})


def numeric_fields(metrics: ShadowMetrics) -> dict[str, float]:
    """Every numeric field (booleans as 0/1; unset ones left out): what the Prometheus gauges export."""
    out = {}
    for name, value in metrics.model_dump().items():
        if isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)):
            out[name] = float(value)
    return out
