"""Messages that cross a process between the trainers, the shadow and the controller.

Each is a typed model, passed as a model end to end: a renamed field fails where it is
used, at import or in a test, not deep into a run. Ray carries them pickled; nothing
here is ever read back from storage (the durable formats are in `storage/`).

    trainer -> controller   TrainerProgress (a segment's end), RecoveryInfo (a restore)
    shadow  -> controller   ShadowMetrics (also `zocheck-ray status` and the gauges)
    controller -> shadow    TrainerTimes (the ranks' step times, for `status`)
    shadow  -> trainer      PushReply (every push), RecoveryOffer (an image to restore from)
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from zocheck_ray.host.handle import ImageHandle

_FROZEN = ConfigDict(extra="forbid", frozen=True)


class PushReply(NamedTuple):
    """The shadow's answer to every push (and ping): what it holds."""

    incarnation: str
    """Which shadow process answered: a new one means it restarted and may lack records."""
    next_step: int
    """The step of the next record it expects (it holds every record before it)."""
    durable_next: int
    """Every record before this step is durable in the step log (the trainer drops them)."""
    accepted: int
    """Records of this push it accepted."""


class AdapterIdentity(BaseModel):
    """What a parameter-efficient run records of its model beside the adapter's state: the frozen base's
    weights' SHA-256 (`workload.adapters.base_identity`) and the adapter's config (its snapshots'
    `adapter_config.json`)."""

    model_config = _FROZEN

    base_hash: str
    """SHA-256 of the frozen base model's weights."""
    adapter_config: dict
    """The peft adapter config, as `adapter_config.json` holds it."""


class RecoveryOffer(BaseModel):
    """What a shadow offers a recovering trainer: its newest image (lent) and the records after it."""

    model_config = _FROZEN

    image: ImageHandle
    """The image, to open on the shadow's node or to stream from elsewhere; give it back when read."""
    records: bytes
    """The encoded records after the image's step (`core.record.decode_records`)."""
    source: str
    """Where the shadow's replica came from: `fresh`, `durable` (rebuilt from storage) or `resync`."""
    adapter: AdapterIdentity | None = None
    """A parameter-efficient run's base and adapter, as the run recorded them (None: full fine-tuning)."""


class PublisherStats(BaseModel):
    """The trainer's publishing of records to the shadow."""

    model_config = _FROZEN

    held_records: int
    """Records sent but not yet known durable (kept to re-send to a restarted shadow)."""
    resent_records: int
    """Records sent again because a restarted shadow lacked them."""
    delivered_records: int
    """Records a data-parallel rank handed the shadow after a lost rank."""
    shadow_restarts_seen: int
    """New shadow incarnations seen in push replies."""
    publish_errors: int
    """Pushes that failed (the shadow died or restarted); what they carried is sent again."""
    last_publish_error: str | None
    """The last push error."""
    gap: str | None
    """Records the shadow lacks that no trainer holds any more (a resync repairs it), if any."""


class KernelCheckInfo(BaseModel):
    """The start-up guard's verdict on the GPU kernels (`core.kernel_guard.KernelCheck`)."""

    model_config = _FROZEN

    backend: str
    """`triton` when the kernels passed and are used, `eager` otherwise."""
    passed: bool | None
    """True: the kernels gave the oracle's bits; False: they did not (or failed); None: not checked."""
    device: str
    dtypes: list[str] = []
    mismatches: list[str] = []
    """What differed (or the error), one line each."""
    reason: str = ""
    seconds: float = 0.0
    checks: int = 0
    """Tensors compared."""


class KernelInfo(BaseModel):
    """Which implementation updates the weights, and on CUDA the start-up guard's verdict."""

    model_config = _FROZEN

    device: str
    """`cpu` or `cuda`."""
    backend: str
    """`fused`/`eager` on the CPU, `triton` or `eager` on CUDA."""
    check: KernelCheckInfo | None = None
    """The start-up guard's verdict (CUDA only)."""


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
    """Data parallel: the step a failed gather interrupted (the state is torn until it rejoins)."""
    evaluations: dict[int, dict[str, float]] = {}
    """Held-out metrics by step, taken in this segment."""
    eval_seconds: float = 0.0
    """Time spent evaluating in this segment."""
    publish_us_median: float | None = None
    """Median cost of publishing one record on the training loop's path (microseconds)."""
    publisher: PublisherStats
    kernel: KernelInfo


Role = Literal["rank", "waiting"]


class RecoveryInfo(BaseModel):
    """How a trainer process came to its state: fresh, restored from an image, or waiting to be told."""

    model_config = _FROZEN

    incarnation: str
    """Which process (a new one after Ray restarts it)."""
    step: int | None
    """The step it is at (None while it waits: a standby, a restarted rank)."""
    source: str
    """`fresh`, `memory` (the shadow's image), `durable` (the shadow rebuilt from storage), `kept` (a
    data-parallel survivor at the common step), `deferred` (waiting to be told what to restore)."""
    role: Role = "rank"
    """`rank`: it serves a rank; `waiting`: a standby, or a process Ray restarted, until it is told to rejoin."""
    image_step: int | None = None
    replayed_records: int = 0
    state_hash: str | None = None
    """With `hash_every_step`: the restored state's hash."""
    state_bytes: int | None = None
    """Bytes of the state restored from the image."""
    seconds: float | None = None
    """The process's set-up (constructor), or the restore when it was told to restore later."""
    build_seconds: float | None = None
    """Building the model (a skeleton when it restores)."""
    restore_seconds: float | None = None
    """Image plus records into the state: the sum of the four parts below."""
    fetch_seconds: float | None = None
    """Asking the shadow for its image and opening it (part of restore)."""
    install_seconds: float | None = None
    """Taking the image in: checking it, its copy (`copy_seconds`) and giving it back (part of restore); about 0
    where it was `preinstalled`."""
    copy_seconds: float | None = None
    """The copy alone within `install_seconds` (the image's bytes into the state, without checking and giving
    back the image); None where it was `preinstalled`."""
    copy_threads: int | None = None
    """The threads that copy ran on (`host.image.transfer_threads`: the CPUs of the process that ran it, up
    to 8)."""
    preinstalled: bool = False
    """The image was in the state already: a CPU standby copies each new image while it waits
    (`Trainer.preinstall`), so a promotion offered the same image only replays the records after it."""
    replay_seconds: float | None = None
    """Replaying the records after the image (part of restore)."""
    replay_threads: int | None = None
    """The threads that replay ran on (on the CPU: numba's pool, in a trainer process more threads than cores
    on a small node, see `actors.trainer_actor.RECOVERY_THREADS`); None where no record was replayed on the
    CPU."""
    hash_seconds: float | None = None
    """Hashing the restored state, with `hash_every_step` (part of restore)."""


class TrainerTimes(BaseModel):
    """The ranks' step times over the controller's last segment (the shadow reports them in `status`)."""

    model_config = _FROZEN

    rank_seconds_per_step: list[float]
    collective_seconds_per_step: float | None = None
    held_out_step: int | None = None
    """The step of the newest held-out evaluation (every `task.eval_interval` steps)."""
    held_out: dict[str, float] = {}
    """Its metrics (`accuracy`; `f1` and `exact_match` for SQuAD; `loss`)."""


class ShadowMetrics(BaseModel):
    """What the shadow reports about itself (also exported through ray.util.metrics)."""

    model_config = _FROZEN

    run_id: str
    """The run these metrics belong to."""
    incarnation: str
    """Which shadow process answers (a new one after Ray restarts the shadow)."""
    trainer_step: int
    """The trainer's step (the next step it will run), as the trainer last reported it."""
    received_step: int
    """Records accepted, in order (the next step expected)."""
    replayed_step: int
    """The replica is at this step (records applied)."""
    lag_steps: int
    """trainer_step - replayed_step: how far the replica is behind the trainer."""
    lag_seconds: float
    """lag_steps times the replay time per step."""
    replay_seconds_per_step: float
    """Recent replay time per step (exponential moving average)."""
    snapshot_interval: int
    """N: steps between snapshots."""
    snapshot_step: int | None
    """Step of the newest in-memory image."""
    durable_step: int | None
    """Step of the newest committed durable snapshot."""
    durable_log_step: int | None
    """Last step whose record is durable in the step log."""
    undurable_steps: int
    """trainer_step minus the steps durable in the log: what a lost node would have to recompute."""
    persist_in_flight: bool
    """A snapshot write to durable storage is in progress (one at a time; newer images skip older ones)."""
    last_persist_seconds: float | None
    """Duration of the last completed snapshot write (log flush included)."""
    snapshots_taken: int
    """In-memory snapshots of the replica (one every N replayed steps)."""
    snapshots_persisted: int
    """Snapshots committed to durable storage."""
    resync_count: int
    """Times the shadow was reset from a copy of the trainer's state (lag above `max_lag_steps`)."""
    rejected_records: int
    """Records refused because they came from the past or the future."""
    persist_failures: int
    """Failed attempts to write the log or a snapshot (each retried with backoff)."""
    persist_failing_seconds: float
    """How long persistence has been failing without a success (0 when it works)."""
    persist_stopped: bool = False
    """Persistence stopped for good: another writer took over the run's storage (see `persist_error`)."""
    ingest_error: str | None = None
    """The last error of the ingest stage (a damaged push)."""
    replay_error: str | None = None
    """The replay stage's error: it stopped, and only a resync from the trainer repairs the replica."""
    persist_error: str | None = None
    """The last error of the persistence stage, the storage's own (a full disk: `StorageFullError ... (ENOSPC)`
    with the path); cleared once a snapshot, or a pass of the log and any image due, goes through (a log
    written while snapshots fail leaves their error)."""
    state_bytes: int = 0
    """Bytes of the run's state (its tensors, without alignment)."""
    replica_bytes: int = 0
    """Bytes the shadow holds for its replica (one copy of the state)."""
    image_bytes: int = 0
    """Bytes the shadow holds for its image (the newest snapshot, which persistence reads in place; an intake
    being written takes its place): one copy of the state."""
    scratch_bytes: int = 0
    """Bytes of the startup profile's scratch copy (1/32 of the state within [64 KiB, 64 MiB]; none after the profile)."""
    held_bytes: int = 0
    """replica_bytes + image_bytes + scratch_bytes: the shadow's state-sized memory now."""
    peak_held_bytes: int = 0
    """The most `held_bytes` has been in this shadow process: by design 2x `state_bytes` plus the scratch."""
    baseline_bytes: int | None = None
    """The process's resident memory before any state arrived (`VmRSS` once its constructor is done: its
    imports, replay kernels, storage clients): what its memory beyond `held_bytes` is measured over. None
    where the state came first (a shadow rebuilt from storage) or /proc is missing."""
    snapshots_deferred: int = 0
    """Snapshot boundaries passed while the image was being persisted (the next boundary takes it: a second
    image would break the memory budget)."""
    recovery_snapshots: int = 0
    """Snapshots taken for a recovering trainer (`JobConfig.recovery_snapshot`: the shadow caught its replica up
    with the records it held and copied it, so the trainer copied the state and replayed none), out of
    `snapshots_taken`."""
    snapshot_seconds: float | None = None
    """The last copy between the replica and an image (a snapshot, or taking in a trainer's state)."""
    snapshot_into_fresh_memory: bool | None = None
    """Whether that copy wrote into memory allocated for it (a new image beside one a borrower held, a rebuilt
    replica), its pages faulted in as it went, rather than into memory already in use (an image reused)."""
    snapshot_threads: int | None = None
    """The threads that copy ran on (the replay's: the shadow's CPUs, as the startup profile chose)."""
    snapshot_seconds_median: float | None = None
    """The median of this process's newest snapshot copies into memory already in use (up to 32 of them):
    steadier than the last one, which a CPU trainer's step beside it may have slowed."""
    snapshot_error: str | None = None
    """Why the last snapshot could not be taken (out of memory), if it could not."""
    rank_seconds_per_step: list[float] = []
    """Each trainer rank's mean step time over the controller's last segment (one entry with one
    trainer; empty until the first segment). Exported as one gauge tagged by `rank`."""
    collective_seconds_per_step: float | None = None
    """Data parallel: the ranks' all-gather per step over the last segment, waits for the slowest rank included."""
    held_out_step: int | None = None
    """The step of the trainers' newest held-out evaluation, as the controller last reported it."""
    held_out: dict[str, float] = {}
    """Its metrics on the held-out rows (`accuracy`, `f1`, `exact_match`, `loss`, ...)."""
    regime: Literal["keep-pace", "lag", "unknown"]
    """The cost model's regime: `keep-pace` (replay faster than training), `lag` (slower), `unknown` (no profile)."""
    source: str
    """Where the replica came from: fresh, durable, resync."""


def numeric_fields(metrics: ShadowMetrics) -> dict[str, float]:
    """Every numeric field (booleans as 0/1; unset ones left out): what the Prometheus gauges export."""
    out = {}
    for name, value in metrics.model_dump().items():
        if isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)):
            out[name] = float(value)
    return out
