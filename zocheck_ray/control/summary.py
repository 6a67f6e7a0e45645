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
    """`software`: the trainer process died; `host`: trainer and shadow were lost (durable storage);
    `unplanned`: a failure nobody injected."""
    recovered_step: int
    """The step the restarted trainer resumed at (the image's step plus the records it replayed)."""
    seconds: float
    """From the failure seen by the controller to the recovered trainer answering."""
    image_source: str
    """Where the image came from: `memory` (the shadow's object-store image) or `durable` (snapshot + log)."""
    image_step: int | None
    """The step of that image."""
    replayed_records: int
    """Records after the image, replayed by the trainer on its own device."""
    rank: int = 0
    """The data-parallel rank that was lost (0 for a single trainer)."""
    cause: Literal["trainer_lost", "records_lost"] = "trainer_lost"
    """What was lost: a rank's process (`trainer_lost`), or records no process held any more (`records_lost`:
    the trainer and the shadow were lost one after the other before the records were durable; every rank
    restored from the shadow's durable image and trained the steps after it again)."""
    replaced_by: Literal["standby", "restart", "torn"] = "restart"
    """What took the lost rank's place: the warm `standby` (promoted at once), its own process restarted by
    Ray (`restart`), or nothing (`torn`: no process was lost, a broken collective left states to restore)."""
    state_hash: str | None = None
    """With `hash_every_step`: the restored state's hash."""
    preinstalled: bool = False
    """The promoted standby held the offered image already (it copies each new one in while it waits, on the
    CPU): its restore replayed the records after the image and copied nothing."""
    copy_threads: int | None = None
    """The threads the image's copy into the state ran on (phase `copy`); None where nothing was copied."""
    replay_threads: int | None = None
    """The threads the replay of the records after the image ran on (phase `replay`; a trainer process's numba
    pool: 8, or one per core on a larger node); None where no record was replayed on the CPU."""
    phases: dict[str, float] = {}
    """Seconds of each part, in order: with data-parallel ranks first `deliver` (the survivors hand the
    shadow its missing records); then `standby` (promoting the standby: no wait) or `restart` (Ray restarts
    the lost process until it answers); `rejoin` (every rank restores at the shadow's step) and, with
    several ranks, `group` (the process group formed again). `constructor` (a restarted process's set-up),
    `restore` (image plus records into the state, in the process that takes the rank), `waited` (the rest of
    `rejoin`: the call's way there and back and its wait behind a call the process was serving, such as a
    standby's copy of a new image), and the parts of `restore`: `fetch` (asking the shadow for its image and
    opening it), `install` (taking the image in; `copy`, the image's bytes into the state, is part of it),
    `replay` (the records after the image) and `hash` (with `hash_every_step`)."""


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
    """(step, training loss of the last step of each segment: the loss at +eps of the perturbed model)."""
    recoveries: list[Recovery]
    """One per trainer loss, in order."""
    metrics: ShadowMetrics
    """The shadow's metrics after the final snapshot was persisted."""
    publish_us_median: float | None
    """Median time the training loop spends publishing one step record (microseconds)."""
    trainer_seconds_per_step: float
    """Wall time per step seen by the controller (evaluation excluded)."""
    snapshot_interval: int
    """N: steps between shadow snapshots (set, or chosen by the startup profile)."""
    profile: ProfileReport | None
    """The startup profile's report (timings, plan), when it ran."""
    storage: str
    """The run's durable storage URL (`<storage>/<run_id>`)."""
    lag_samples: list[tuple[int, int]] = []
    """(step, lag_steps) at each metrics poll, after any resync."""
    step_hashes: dict[int, str] = {}
    """With `hash_every_step`: the trainer's state_hash after each step (the last one computed)."""
    resumed_from_step: int | None = None
    """The step a run found in its durable storage and resumed from; None for a fresh run."""
    task: dict = {}
    """The task: kind, training and held-out rows, metric, tokenizer."""
    metric: str = "accuracy"
    """The held-out metric that tells progress (`accuracy`, or `loss` for language modelling)."""
    evaluations: dict[int, dict[str, float]] = {}
    """Held-out metrics by step: at step 0, every `task.eval_interval` steps and at the last step."""
    metric_before: float | None = None
    """`metric` at the first evaluated step (step 0 for a fresh run)."""
    metric_after: float | None = None
    """`metric` at the last step."""
    eval_seconds: float = 0.0
    """Trainer time spent evaluating (not counted in `trainer_seconds_per_step`)."""
    shadow_restarts: int = 0
    """Times the shadow process was lost and restarted by Ray (it came back from durable storage)."""
    resent_records: int = 0
    """Records the trainer sent again because a restarted shadow lacked them."""
    resyncs: list[tuple[int, str]] = []
    """(step, why) of each resync of the shadow from the trainer."""
    warnings: list[str] = []
    """What went wrong without ending the run (storage failing, durability behind), in order."""
    states: list[str] = []
    """The controller's states, in the order it went through them."""
    kernel: KernelInfo | None = None
    """The trainer's device, its kernel backend (`triton` on CUDA once the start-up guard passed, else
    `eager`) and the guard's result; a guard that failed also leaves a warning."""
    trainers: int = 1
    """Data-parallel ranks (`trainers`)."""
    rank_state_hashes: list[str] = []
    """With several ranks: every rank's `state_hash` at the end, in rank order (all equal when exact)."""
    rank_seconds_per_step: list[float] = []
    """With several ranks: each rank's mean step time (its forward passes, the gather and the update)."""
    collective_seconds_per_step: float | None = None
    """With several ranks: mean seconds per step in the all-gather of the loss sums (waiting for the
    slowest rank included), over all ranks."""
    profile_check: dict[str, dict[str, float]] = {}
    """With a startup profile: for the trainer step and the replay step, the profiled and the run's
    steady-state seconds and their ratio (steady / profiled); a ratio beyond `PROFILE_TOLERANCE`
    either way is also a warning (the snapshot interval was chosen on numbers that did not hold)."""


class RunFailedError(RuntimeError):
    """The run could not go on; the message says why and what to do."""
