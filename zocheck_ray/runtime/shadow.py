"""The shadow: a pipeline that replays step records on a host replica, snapshots it, persists it.

    ingest   the caller's thread: decode, check the order, accept into the `RecordLedger`.
    replay   its own thread, owner of the replica: applies records up to each multiple of N, then
             snapshots; the image goes to the ledger (for recovering trainers) and to persistence.
    persist  its own thread, owner of the store and the step log: makes records and the newest
             image durable, retrying through outages, so ingest never waits for storage.

`Shadow` is Ray-free (`ShadowActor` is its transport); other threads reach the replay stage only
through `ReplayStage.call`.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import uuid
from typing import Callable

import torch

from zocheck_ray.runtime.errors import ShadowRestartedError, StageError
from zocheck_ray.host.image import ImageBuffer, ImageGoneError, ImageLayout, copy_state
from zocheck_ray.host.memory import frombuffer, process_memory
from zocheck_ray.runtime.ledger import RecordLedger
from zocheck_ray.runtime.messages import AdapterIdentity, ShadowMetrics, ShadowStatus, TrainerTimes
from zocheck_ray.runtime.publisher import PushReply
from zocheck_ray.runtime.persist import MAX_BACKOFF_SECONDS, STARTUP_STORAGE_SECONDS, PersistStage
from zocheck_ray.runtime.replay import Image, ReplayStage
from zocheck_ray.config import JobConfig
from zocheck_ray.core import StepRecord
from zocheck_ray.core.errors import CorruptRecordError
from zocheck_ray.core.fused import warm_up
from zocheck_ray.core.record import decode_records
from zocheck_ray.runtime.best_dev import PIN, BestDev
from zocheck_ray.runtime.hooks import NO_HOOKS, ShadowHooks
from zocheck_ray.storage import (CorruptSnapshotError, Lease, LeaseError, RulesVersionError, SnapshotNotFoundError,
                                 SnapshotStore, StorageError, StorageRefusedError, recover)
from zocheck_ray.core.dtypes import JOB_DTYPES
from zocheck_ray.workload.errors import WorkloadError
from zocheck_ray.workload.models import snapshot_config
from zocheck_ray.workload.names import model_directory
from zocheck_ray.workload.tokenization import snapshot_tokenizer_files

logger = logging.getLogger(__name__)

ADAPTER_KEY = "adapter"
"""The key of a parameter-efficient run's `AdapterIdentity` in its snapshots' user metadata."""
BASE_KEY = "base"
"""An adapter snapshot's base: the job's model, dtype and run_seed, from which a built-in base is built again."""


class Shadow:
    """Ingest, replay and persistence of one run's records (see the module docstring)."""

    def __init__(self, job: JobConfig, threads: int | None = None, persist: bool = True,
                 hooks: ShadowHooks = NO_HOOKS, writer: str | None = None, nice: int = 0):
        """`writer` names this shadow in the run's lease: a restarted shadow passes the same name and reclaims its
        predecessor's lease, any other live writer is refused. `nice`: the replay and persistence threads'."""
        self.job = job
        self.hooks = hooks
        self.incarnation = uuid.uuid4().hex[:12]
        self.trainer_step: int | None = None
        self.rank_seconds_per_step: list[float] = []
        self.standby = "none"
        self.group: dict = {}
        """The ranks and their shards, as the controller last reported them (`note_trainers`)."""
        self.collective_seconds_per_step: float | None = None
        self.held_out_step: int | None = None
        self.held_out: dict[str, float] = {}
        self.rejected = 0
        self.last_rejection = ""
        self.ingest_error: str | None = None
        self.regime = "unknown"
        self.adapter: AdapterIdentity | None = None
        """A parameter-efficient run's base and adapter, from its first trainer or its durable snapshot."""
        self.model_config: dict | None = None
        """The model's Hugging Face config for every snapshot of a full run, from the first trainer or the durable
        snapshot (the shadow never imports transformers to build it)."""
        self._tokenizer: dict[str, str] | None = None  # `_tokenizer_files`, once known
        warm = threading.Thread(target=warm_up, args=(JOB_DTYPES[job.dtype], job.zo), name="zocheck-warm-up")
        warm.start()  # the replay kernel loads while storage is read; profiles then time the kernel, not its load
        self.ledger = RecordLedger(0, on_accept=lambda: self.replay.wake())
        self.persist: PersistStage | None = None
        self.best_dev = BestDev(job)
        self.replay = ReplayStage(self.ledger, job, self._on_image, threads, hooks, token_prefix=self.incarnation,
                                  nice=nice, forced=self.best_dev.forced, hold_forced=persist)
        self.lease: Lease | None = None
        if persist:
            self.lease = _with_retries(lambda: Lease(job.run_url, job.storage_options,
                                                     owner=writer or f"shadow:{job.run_id}:{self.incarnation}",
                                                     lease_seconds=job.durability.lease_seconds).acquire(reclaim=True),
                                       f"taking the lease of {job.run_url}")
            self.lease.start_heartbeat()
            store = _with_retries(lambda: SnapshotStore(job.run_url, job.storage_options, lease=self.lease),
                                  f"opening the snapshot store {job.run_url}")
            self.persist = PersistStage(self.ledger, job, store, self.lease, self._snapshot_meta, nice=nice,
                                        holds=self.best_dev.holds)
            try:
                self.best_dev.restore(_with_retries(self.persist.load_retention, f"reading {job.run_url}'s retention"))
                self._durable_rebuild(store)
            except BaseException:  # storage nothing can resume from: the next writer need not wait for the lease
                self.lease.release()
                raise
        warm.join()
        self.baseline_bytes = process_memory().get("VmRSS") if self.replay.layout is None else None
        self.replay.start()
        if self.persist is not None:
            self.persist.start()

    def _snapshot_meta(self) -> dict:
        """What the next snapshot carries besides the tensors (a peft adapter's config, or the model's)."""
        meta = {"run_id": self.job.run_id, "zo_config": self.job.zo.model_dump(mode="json")}
        if self.job.peft is None:
            if self.model_config is None:  # a caller that gave none (the trainers of a run give theirs)
                self.model_config = snapshot_config(self.job.model, self.job.dtype)
            meta["hf_config"] = self.model_config
            meta["text_files"] = self._tokenizer_files()
        elif self.adapter is not None:
            meta["adapter_config"] = self.adapter.adapter_config
            meta["user"] = {ADAPTER_KEY: self.adapter.model_dump(mode="json"), BASE_KEY: {
                "model": self.job.model, "dtype": self.job.dtype, "run_seed": self.job.run_seed}}
        return meta

    def _tokenizer_files(self) -> dict[str, str]:
        """The run's tokenizer, for `AutoTokenizer` (`snapshot_tokenizer_files`), read once."""
        if self._tokenizer is None:
            vocab, job = self.model_config.get("vocab_size"), self.job
            try:
                self._tokenizer = {} if vocab is None else \
                    snapshot_tokenizer_files(model_directory(job.model), vocab, job.task.tokenizer, job.model)
            except (WorkloadError, OSError, UnicodeDecodeError) as exc:  # the model directory is not readable here
                logger.warning("snapshots carry no tokenizer: %s", exc)
                self._tokenizer = {}
        return self._tokenizer

    def _on_image(self, image: Image) -> None:
        if self.persist is not None:
            self.persist.wake()

    def _durable_rebuild(self, store: SnapshotStore) -> None:
        latest = _with_retries(store.latest, f"listing the snapshots of {self.job.run_url}")
        if latest is None:
            return
        # Read into the image's memory and replayed there, then copied into the replica: two copies of the state at the
        # peak, as in every other phase.
        layout = ImageLayout.from_specs([(t.name, t.dtype, tuple(t.shape)) for t in latest.manifest.tensors])
        buffer = self.replay.open_intake(layout)
        # A held step the log passes without its snapshot (the shadow was lost before it was durable) is saved now,
        # where undecided or pinned: the trainer evaluated it, or will, and only this replay passes it again.
        committed, saved = {info.step for info in store.committed()}, set()
        best = self.best_dev

        def save_held(step: int, state: dict, meta) -> None:
            self._take_meta(meta)
            store.save(step, state, self._snapshot_meta(), hold=True)
            saved.add(step)

        result = _with_retries(lambda: recover(store, self.job.run_url, storage_options=self.job.storage_options,
                                               config=self.job.zo, threads=self.replay.threads,
                                               out=layout.views(buffer.bytes), pause=save_held,
                                               pause_at=lambda step: step not in committed and best.holds(step) and (
                                                   step > best.released_through or step == best.step)),
                               f"rebuilding from {self.job.run_url}")
        for problem in result.problems:
            logger.warning("durable recovery: %s", problem)
        try:  # so that nothing reads a damaged snapshot as durable, and its step is written again
            store.set_aside_newer(result.snapshot.step, keep=frozenset(saved))
        except StorageError as exc:  # the next save of that step sets it aside (SnapshotStore.save)
            logger.warning("could not set aside the damaged snapshots after step %d: %s", result.snapshot.step, exc)
        self._take_meta(result.meta)
        if saved:
            self.persist.load_retention()  # a pinned step among them: its URL
        self.replay.commit_intake(result.step, "durable")
        self.persist.durable_step = result.snapshot.step
        logger.info("shadow rebuilt from durable storage at step %d (%d records replayed)", result.step,
                    result.records_replayed)

    def _take_meta(self, meta) -> None:
        """A durable snapshot's adapter and model config, for the snapshots this shadow writes."""
        recorded = meta.user.get(ADAPTER_KEY)
        if recorded is not None:
            self.adapter = AdapterIdentity.model_validate(recorded)
        if meta.hf_config is not None:
            self.model_config = meta.hf_config

    # ------------------------------------------------------------------ state in

    def open_intake(self, layout: ImageLayout) -> ImageBuffer:
        """Memory for a trainer to write its state of `layout` into; then `initialize`, `resync` or `abort_intake`."""
        return self.replay.call(lambda: self.replay.open_intake(layout))

    def abort_intake(self) -> None:
        self.replay.call(self.replay.abort_intake)

    def initialize(self, step: int, state: dict[str, torch.Tensor] | None = None, timeout: float = 300.0,
                   adapter: AdapterIdentity | None = None, model_config: dict | None = None) -> None:
        """A fresh run: the trainer's initial state at `step` (in the intake, or given here), made durable before
        training starts."""
        if adapter is not None:
            self.adapter = adapter
        if model_config is not None:
            self.model_config = model_config
        if state is not None:
            self._fill_intake(state)
        self.replay.call(lambda: self.replay.commit_intake(step, "fresh"))
        if self.persist is not None and not self.persist.wait_durable(step, timeout):
            raise StageError("the initial image could not be made durable" + (
                f": {self.persist.stopped}" if self.persist.stopped else
                f": storage is full ({self.persist.error})" if self.persist.full else
                f" in {timeout:.0f} s: {self.persist.error or 'storage did not answer'}"))

    def resync(self, step: int, state: dict[str, torch.Tensor] | None = None, wait_seconds: float = 60.0) -> None:
        """Replace the replica with the trainer's state at `step`, after waiting up to `wait_seconds` for the records
        before it so that the log stays whole."""
        if state is not None:
            self._fill_intake(state)
        if wait_seconds > 0:
            self.ledger.wait_for(step, wait_seconds)
        self.replay.call(lambda: self.replay.commit_intake(step, "resync"))

    def _fill_intake(self, state: dict[str, torch.Tensor]) -> None:
        layout = ImageLayout.of(state)
        buffer = self.open_intake(layout)
        copy_state(layout.views(buffer.bytes), state)

    @property
    def ready(self) -> bool:
        return self.replay.replica is not None

    # ------------------------------------------------------------------ ingest

    def push(self, data: bytes, trainer_step: int | None = None) -> PushReply:
        """Receive encoded records (none: a ping) and the trainer's current step."""
        if trainer_step is not None:
            self.trainer_step = trainer_step
        accepted = 0
        try:
            records = decode_records(data)
        except CorruptRecordError as exc:
            self.ingest_error = f"a damaged push was refused: {exc}"
            logger.error(self.ingest_error)
            records = []
        if records:
            accepted, refused = self.ledger.accept(records)
            if refused:
                self.rejected += len(refused)
                self.last_rejection = refused[-1]
                logger.warning("%d of %d records refused; last: %s", len(refused), len(records), refused[-1])
        return PushReply(self.incarnation, self.ledger.next_step, self._durable_next(), accepted)

    def _durable_next(self) -> int:
        if self.persist is None:
            return self.ledger.next_step
        durable = self.persist.durable_log_step
        return durable + 1 if durable is not None else self.ledger.generation_start

    # ------------------------------------------------------------------ out

    def recovery_view(self, lend: bool = False) -> tuple[Image | None, list[StepRecord]]:
        """The newest image and every accepted record after it; `lend`: not written again until `give_back`."""
        return self.ledger.recovery_view(lend=lend)

    def offer(self, fresh: bool, held: str | None = None) -> tuple[Image | None, list[StepRecord]]:
        """What a trainer recovers from: `recovery_view(lend=True)`, after a caught-up snapshot where `fresh`
        (`ReplayStage.snapshot_caught_up`). Not where the newest image is `held` by a CPU standby and the replica
        lags: the standby replays the records sooner at its own priority than the shadow at its low one."""
        if fresh and not (held is not None and self._lags_behind(held)):
            self.replay.call(self.replay.snapshot_caught_up)
        return self.recovery_view(lend=True)

    def newer_image(self, token: str | None, timeout: float) -> int | None:
        """Wait up to `timeout` s for an image other than `token`; its step, or None."""
        return self.ledger.wait_newer(token, timeout)

    def _lags_behind(self, token: str) -> bool:
        """The newest image is `token` and the replica has records it has not replayed yet."""
        image = self.ledger.image
        return image is not None and image.token == token and self.replay.replayed_step < self.ledger.next_step

    def image_bytes(self, token: str, start: int, length: int):
        """Bytes `start..start+length` of the offered image `token`, for a reader on another node."""
        image = self.ledger.image
        if image is None or image.token != token:
            raise ImageGoneError(f"the image {token} has been replaced; ask for the newest")
        return image.buffer.bytes[start: start + length].numpy().copy()

    def write_intake(self, start: int, data) -> None:
        """Bytes `data` (a uint8 array) at `start` of the open intake, from a trainer that cannot open it."""
        intake = self.replay.intake
        if intake is None or start < 0 or start + len(data) > intake.nbytes:
            raise StageError(f"no open intake holds bytes {start}..{start + len(data)}: open one first")
        intake.bytes[start: start + len(data)].copy_(frombuffer(data))

    def give_back(self, token: str) -> None:
        """A trainer is done reading the image `token`."""
        self.ledger.give_back(token)

    def drain(self, step: int, timeout: float = 300.0, incarnation: str | None = None) -> ShadowMetrics:
        """Wait for every record before `step`, replay them, snapshot at `step`, make it all durable.

        `incarnation`: the shadow the caller handed the records to; another (a restarted process Ray retried
        the call on) refuses at once with `ShadowRestartedError` rather than wait for records it lacks."""
        if incarnation is not None and incarnation != self.incarnation:
            raise ShadowRestartedError(f"the shadow restarted (incarnation {self.incarnation}, not {incarnation}): "
                                       f"it holds records up to step {self.ledger.next_step}")
        deadline = time.monotonic() + timeout
        if not self.ledger.wait_for(step, timeout):
            raise StageError(f"the shadow received records up to step {self.ledger.next_step}, not {step}, "
                             f"within {timeout:.0f} s")
        if not self.replay.wait_replayed(step, max(deadline - time.monotonic(), 0.0)):
            raise StageError(f"the shadow replayed up to step {self.replay.replayed_step}, not {step}, within "
                             f"{timeout:.0f} s" + (f": {self.replay.error}" if self.replay.error else ""))
        self.replay.call(lambda: self.replay.snapshot_now(step))
        if self.persist is not None and not self.persist.wait_durable(step, max(deadline - time.monotonic(), 0.0)):
            raise StageError(f"the image of step {step} and its log are not durable"
                             + (f": {self.persist.stopped}" if self.persist.stopped else
                                f": storage is full ({self.persist.error})" if self.persist.full else
                                f" after {timeout:.0f} s: {self.persist.error or 'storage is slow'}"))
        return self.metrics()

    def profile_replay(self, threads: int) -> float | None:
        return self.replay.call(lambda: self.replay.profile_replay(threads))

    def profile_snapshot(self) -> float:
        return self.replay.call(self.replay.profile_snapshot)

    def end_profile(self, threads: int, snapshot_interval: int, regime: str = "unknown",
                    durable_interval: int | None = None) -> None:
        """The profile's choices: replay threads, N, and the durable interval (a multiple of N)."""
        self.regime = regime
        self.replay.call(lambda: self.replay.end_profile(threads, snapshot_interval))
        if self.persist is not None:
            self.persist.durable_interval = durable_interval or snapshot_interval

    def replica_hash(self) -> tuple[int, str]:
        return self.replay.call(self.replay.replica_hash)

    @property
    def last_persist_seconds(self) -> float | None:
        return self.persist.last_persist_seconds if self.persist is not None else None

    def status(self) -> ShadowStatus:
        """What the controller decides on; cheap (no memory or copy statistics)."""
        replay, persist = self.replay, self.persist
        received, replayed = self.ledger.next_step, replay.replayed_step
        trainer = self.trainer_step if self.trainer_step is not None else received
        image = self.ledger.image
        durable_log = persist.durable_log_step if persist else None
        return ShadowStatus(
            run_id=self.job.run_id, incarnation=self.incarnation, trainer_step=trainer, received_step=received,
            replayed_step=replayed, lag_steps=max(trainer - replayed, 0), replay_seconds_per_step=replay.replay_ema,
            snapshot_interval=replay.snapshot_interval, snapshot_step=image.step if image else None,
            durable_step=persist.durable_step if persist else None, durable_log_step=durable_log,
            undurable_steps=(trainer - (durable_log + 1 if durable_log is not None else self.ledger.generation_start))
            if persist else 0,
            persist_in_flight=persist.persist_in_flight if persist else False,
            persist_failures=persist.failures if persist else 0,
            persist_stopped=persist.stopped is not None if persist else False,
            persist_stop_reason=persist.stop_reason if persist else None,
            durable_interval=persist.durable_interval if persist else None,
            replay_error=replay.error, persist_error=persist.error if persist else None)

    def metrics(self) -> ShadowMetrics:
        """The status and the stats, for `status`, the gauges and the summary."""
        status = self.status()
        replay, persist = self.replay, self.persist
        failing = persist.failing_since if persist else None
        copies = list(replay.touched_copies)  # taken at once: the replay thread appends to it meanwhile
        return ShadowMetrics(
            **status.model_dump(), lag_seconds=status.lag_steps * replay.replay_ema,
            last_persist_seconds=self.last_persist_seconds, snapshots_taken=replay.snapshots_taken,
            snapshots_persisted=persist.snapshots_persisted if persist else 0, resync_count=replay.resync_count,
            rejected_records=self.rejected,
            persist_failing_seconds=time.monotonic() - failing if failing is not None else 0.0,
            ingest_error=self.ingest_error, state_bytes=replay.layout.state_bytes if replay.layout is not None else 0,
            **{f"{purpose}_bytes": n for purpose, n in replay.budget.held.items()},
            held_bytes=sum(replay.budget.held.values()), peak_held_bytes=replay.budget.peak,
            baseline_bytes=self.baseline_bytes,
            snapshots_deferred=replay.snapshots_deferred, recovery_snapshots=replay.recovery_snapshots,
            snapshot_error=replay.snapshot_error,
            snapshot_seconds=replay.last_copy_seconds, snapshot_into_fresh_memory=replay.last_copy_fresh,
            snapshot_threads=replay.last_copy_threads,
            snapshot_seconds_median=statistics.median(copies) if copies else None,
            rank_seconds_per_step=self.rank_seconds_per_step, standby=self.standby,
            collective_seconds_per_step=self.collective_seconds_per_step, regime=self.regime, source=replay.source,
            held_out_step=self.held_out_step, held_out=self.held_out, **self.group,
            best_dev_step=self.best_dev.step, best_dev_loss=self.best_dev.loss,
            best_dev_snapshot=persist.pinned.get(PIN, (None, None))[1] if persist else None,
        )

    def note_dev(self, losses: dict[int, float], through: int) -> None:
        """The trainer's dev losses by step, evaluated up to `through`: the best is pinned, the rest released."""
        if self.best_dev.note(losses, through) and self.persist is not None:
            self.persist.want_retention(self.best_dev.retention())

    def note_trainers(self, times: TrainerTimes) -> None:
        """The trainers' step times, as the controller measured them over its last segment."""
        self.rank_seconds_per_step = list(times.rank_seconds_per_step)
        self.collective_seconds_per_step = times.collective_seconds_per_step
        self.held_out_step, self.held_out = times.held_out_step, dict(times.held_out)
        self.standby = times.standby
        self.group = {"ranks": times.ranks, "rank_shards": [list(h) for h in times.rank_shards],
                      "group_changes": times.group_changes, "last_group_change": times.last_group_change}

    def close(self) -> bool:
        """Stop the stages (persistence seals the log first), then release the lease; returns whether it was
        released."""
        released = self.persist is None
        self.replay.stop()
        if self.persist is not None:
            self.persist.stop()
            if self.persist.log is not None:
                try:
                    self.persist.log.close()
                except (StorageError, LeaseError) as exc:
                    logger.warning("closing the step log: %s", exc)
            released = self.lease.release()
        self.replay.close()
        return released


def _with_retries(fn: Callable[[], object], what: str, seconds: float = STARTUP_STORAGE_SECONDS):
    """`fn()`, retried with backoff while storage fails, for at most `seconds`."""
    deadline, backoff = time.monotonic() + seconds, 0.1
    while True:
        try:
            return fn()
        except (CorruptSnapshotError, RulesVersionError, SnapshotNotFoundError, StorageRefusedError):
            raise  # damage, or a store that refuses writes, not an outage: waiting does not mend it
        except StorageError as exc:
            if time.monotonic() + backoff > deadline:
                raise StorageError(f"{what}: storage did not answer for {seconds:.0f} s: {exc}") from exc
            logger.warning("%s failed, retrying in %.1f s: %s", what, backoff, exc)
            time.sleep(backoff)
            backoff = min(2 * backoff, MAX_BACKOFF_SECONDS)
