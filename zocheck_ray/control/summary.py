"""What a run reports: `RunSummary` (with one `Recovery` per lost trainer) and `RunFailedError`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from zocheck_ray.runtime.messages import KernelInfo, ShadowMetrics
from zocheck_ray.policies import ProfileReport


class Recovery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    failed_at_step: int
    """The step the trainer was at when it was lost."""
    mode: Literal["software", "host", "unplanned"]
    """`software` (the trainer died), `host` (trainer and shadow lost) or `unplanned` (not injected)."""
    recovered_step: int
    """The step the trainer resumed at (the image's step plus the replayed records)."""
    seconds: float
    """From the controller seeing the failure to the recovered trainer answering."""
    image_source: str
    """`memory` (the shadow's image) or `durable` (snapshot plus log)."""
    image_step: int | None
    """The step of that image."""
    replayed_records: int
    """Records after the image that the trainer replayed."""
    rank: int = 0
    """The data-parallel rank that was lost (0 for a single trainer)."""
    cause: Literal["trainer_lost", "records_lost"] = "trainer_lost"
    """`trainer_lost` (a rank's process) or `records_lost` (records no process held: every rank restored
    the durable image and trained the steps after it again)."""
    replaced_by: Literal["standby", "restart", "torn"] = "restart"
    """`standby` (promoted), `restart` (Ray restarted the process) or `torn` (no process lost; a broken
    collective left states to restore)."""
    state_hash: str | None = None
    """With `hash_every_step`: the restored state's hash."""
    preinstalled: bool = False
    """The promoted standby already held the image, so its restore only replayed records."""
    copy_threads: int | None = None
    """Threads of the image copy (phase `copy`); None if nothing was copied."""
    read_through: str | None = None
    """How the image was read: `memfd` (opened on the shadow's node) or `ray` (its windows through Ray)."""
    replay_threads: int | None = None
    """Threads of the CPU replay (phase `replay`); None if nothing was replayed on the CPU."""
    phases: dict[str, float] = {}
    """Seconds of each part, in order: `deliver` (survivors' records to the shadow), `standby` or
    `restart`, `rejoin` (every rank restores) and `group` (the process group re-formed). Within them:
    `constructor`, `restore` and its parts `fetch`, `install` (including `copy`), `replay`, `hash`, and
    `waited` (the rest of `rejoin`)."""


class GroupChange(BaseModel):
    """An elastic group formed anew mid-run: without lost ranks (`shrink`) or with a rank back (`join`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["shrink", "join"]
    step: int

    ranks: int
    """Ranks after the change."""
    held: list[list[int]]
    """Each rank's shards after the change."""
    cause: str
    stall_seconds: float
    """The others' wait: the slowest survivor's (`shrink`), or the joiner's restore and the new group."""
    plan_wait_seconds: float | None = None
    """Of a shrink's stall: the wait for the controller's plan (its detection of the loss included)."""


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
    """(step, training loss at +eps) for the last step of each segment."""
    recoveries: list[Recovery]
    """One per trainer loss, in order."""
    metrics: ShadowMetrics
    """The shadow's metrics after the final snapshot was persisted."""
    publish_us_median: float | None
    """Median microseconds the training loop spends publishing one step record."""
    trainer_seconds_per_step: float
    """Wall time per step seen by the controller (evaluation excluded)."""
    snapshot_interval: int
    """Steps between shadow snapshots (set, or chosen by the startup profile)."""
    profile: ProfileReport | None
    """The startup profile's report, when it ran."""
    storage: str
    """The run's durable storage URL (`<storage>/<run_id>`)."""
    lag_samples: list[tuple[int, int]] = []
    """(step, lag_steps) at each metrics poll, after any resync."""
    step_hashes: dict[int, str] = {}
    """With `hash_every_step`: the trainer's state_hash after each step."""
    resumed_from_step: int | None = None
    """The durable step the run resumed from; None for a fresh run."""
    task: dict = {}
    """The task: kind, training and held-out rows, metric, tokenizer."""
    metric: str = "accuracy"
    """The held-out metric: `accuracy`, or `loss` for language modelling."""
    evaluations: dict[int, dict[str, float]] = {}
    """Held-out metrics by step: at step 0, every `task.eval_interval` steps and at the last step."""
    samples: dict[int, list[tuple[str, str]]] = {}
    """Kind `sft`: each evaluation's greedy generations from held-out prompts, (prompt, text), by step."""
    metric_before: float | None = None
    """`metric` at the first evaluated step (step 0 for a fresh run)."""
    metric_after: float | None = None
    """`metric` at the last step."""
    best_dev_step: int | None = None
    """With MeZO's dev rows: the step MeZO's `--load_best_model_at_end` keeps (`best_dev_step`; the shadow's
    choice, which a resumed run carries over)."""
    best_dev_snapshot: str | None = None
    """That step's durable snapshot, pinned against retention: load it with `from_pretrained`."""
    eval_seconds: float = 0.0
    """Trainer time spent evaluating (not counted in `trainer_seconds_per_step`)."""
    shadow_restarts: int = 0
    """Times Ray restarted a lost shadow (it came back from durable storage)."""
    resent_records: int = 0
    """Records the trainer sent again because a restarted shadow lacked them."""
    resyncs: list[tuple[int, str]] = []
    """(step, why) of each resync of the shadow from the trainer."""
    warnings: list[str] = []
    """What went wrong without ending the run, in order."""
    states: list[str] = []
    """The controller's states, in the order it went through them."""
    kernel: KernelInfo | None = None
    """The trainer's device, kernel backend (`triton` or `eager`) and the start-up guard's result."""
    trainers: int = 1
    """Data-parallel ranks (`scaling.trainers`)."""
    group_changes: list[GroupChange] = []
    """Elastic data parallel: each change of the ranks, in order (`scaling.trainers: {min, max}`)."""
    rank_state_hashes: list[str] = []
    """With several ranks: each rank's final `state_hash` (all equal when exact)."""
    rank_seconds_per_step: list[float] = []
    """With several ranks: each rank's mean seconds per step."""
    collective_seconds_per_step: float | None = None
    """With several ranks: mean seconds per step in the loss all-gather, waits included."""
    profile_check: dict[str, dict[str, float]] = {}
    """With a startup profile: profiled and steady seconds of the trainer and replay steps, and their
    ratio; one beyond `PROFILE_TOLERANCE` also warns, as the interval was chosen on them."""


def best_dev_step(evaluations: dict[int, dict[str, float]]) -> int | None:
    """The lowest `dev_loss` after step 0, the first on ties; None without dev rows."""
    scored = [(m["dev_loss"], step) for step, m in sorted(evaluations.items()) if step > 0 and "dev_loss" in m]
    return min(scored)[1] if scored else None


class RunFailedError(RuntimeError):
    """The run could not go on; the message says why and what to do."""
