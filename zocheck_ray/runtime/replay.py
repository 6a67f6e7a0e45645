"""The shadow's replay stage (`shadow.py` describes the pipeline): `ReplayStage` owns the replica and the image
memory; other threads reach it only through `call`. Also the images it hands on, the memory budget by purpose, and
the startup profile's scratch copy."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch

from zocheck_ray.config import JobConfig
from zocheck_ray.core import StepRecord, ZOConfig, replay, state_hash
from zocheck_ray.core.fused import default_threads
from zocheck_ray.core.layout import ALL_MOMENT_PREFIXES, Layout, moment_prefixes
from zocheck_ray.host.image import ImageBuffer, ImageLayout, anonymous_buffer, copy_state, image_memory
from zocheck_ray.host.priority import background_thread
from zocheck_ray.runtime.errors import StageError
from zocheck_ray.runtime.hooks import ShadowHooks
from zocheck_ray.runtime.ledger import RecordLedger

logger = logging.getLogger(__name__)

MAX_REPLAY_BATCH = 64
COPY_HISTORY = 32
"""How many of the newest snapshot copies `ShadowMetrics.snapshot_seconds_median` is taken over."""


class Image:
    """A frozen copy of the replica at `step`; `lent`, `pinned` and `hold` change only in the ledger, under its
    lock."""

    def __init__(self, step: int, buffer: ImageBuffer, layout: ImageLayout, token: str, hold: bool = False):
        self.step, self.buffer, self.layout, self.token = step, buffer, layout, token
        self.lent = 0
        self.read_until = 0.0
        self.pinned = False
        self.hold = hold
        """Not written over until persistence saved it (a dev evaluation's step)."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The image's tensors: views of its buffer, never written."""
        return self.layout.views(self.buffer.bytes)


class Budget:
    """The shadow's bytes of state-sized memory by purpose, and their peak (written by the replay thread only)."""

    def __init__(self):
        self.held: dict[str, int] = {"replica": 0, "image": 0, "scratch": 0}
        self.peak = 0

    def set(self, purpose: str, nbytes: int) -> None:
        self.held[purpose] = nbytes
        self.peak = max(self.peak, sum(self.held.values()))

    def add(self, purpose: str, nbytes: int) -> None:
        self.set(purpose, self.held[purpose] + nbytes)


# ---------------------------------------------------------------------------------------- replay


class ReplayStage:
    """Owns the replica and the image memory: applies the ledger's records, snapshots at multiples of N and at
    the steps `forced` names (held until durable where `hold_forced`)."""

    def __init__(self, ledger: RecordLedger, job: JobConfig, on_image: Callable[[Image], None],
                 threads: int | None, hooks: ShadowHooks, token_prefix: str = "", nice: int = 0,
                 forced: Callable[[int], int | None] = lambda step: None, hold_forced: bool = False):
        """`forced(step)`: the first step after `step` that must have its own image, or None."""
        self.ledger = ledger
        self._forced, self._hold_forced = forced, hold_forced
        self._nice = nice
        self.zo = job.zo
        self.threads = threads
        self.snapshot_interval = job.shadow.snapshot_interval or 16
        self._on_image = on_image
        self._hooks = hooks
        self._name = f"zocheck-image-{job.run_id}"
        self._tokens = (f"{token_prefix}-{i}" for i in itertools.count())
        self.replica: dict[str, torch.Tensor] | None = None
        self._replica_memory = None
        self.layout: ImageLayout | None = None
        self.intake: ImageBuffer | None = None
        """Memory a trainer writes its state into, until committed."""
        self._intake_layout: ImageLayout | None = None
        self.budget = Budget()
        self.replayed_step = 0
        self.source = "none"
        self.replay_ema = 0.0
        self.snapshots_taken = 0
        self.snapshots_deferred = 0
        self.recovery_snapshots = 0
        self.snapshot_error: str | None = None
        self.last_copy_seconds: float | None = None
        self.last_copy_bytes = 0
        self.last_copy_fresh: bool | None = None
        self.last_copy_threads: int | None = None
        self.touched_copies: collections.deque[float] = collections.deque(maxlen=COPY_HISTORY)
        """The newest copies into memory in use: one copy is a noisy sample, so their median is the figure."""
        self.resync_count = 0
        self.error: str | None = None
        self.last_record: StepRecord | None = None
        self._scratch: ProfileScratch | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._progress = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="zocheck-replay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def call(self, fn: Callable[[], object], timeout: float | None = 300.0):
        """Run `fn` on the replay thread between batches; returns its result or raises its error."""
        if not self._thread.is_alive():
            return fn()  # not started yet (construction) or stopped: nobody else touches the replica
        future: Future = Future()
        self._commands.put((fn, future))
        self._wake.set()
        return future.result(timeout)

    def wait_replayed(self, step: int, timeout: float) -> bool:
        with self._progress:
            return self._progress.wait_for(lambda: self.replayed_step >= step or self.error is not None, timeout) \
                and self.replayed_step >= step

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        background_thread(self._thread.name, self._nice)
        while not self._stop.is_set():
            self._wake.wait(0.05)
            self._wake.clear()
            while not self._stop.is_set():
                self._run_commands()
                if not self._replay_batch():
                    break

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def _replay_batch(self) -> bool:
        if self.replica is None or self.error is not None or self._hooks.replay_stalled:
            return False
        if self._forced_missing():
            return False  # a forced step waits for its image: replaying on would lose that state
        n = self.snapshot_interval
        boundary = (self.replayed_step // n + 1) * n
        forced = self._forced(self.replayed_step)
        if forced is not None:
            boundary = min(boundary, forced)
        batch = self.ledger.read(self.replayed_step, boundary, MAX_REPLAY_BATCH)
        if not batch:
            return False
        started = time.perf_counter()
        try:
            replay(self.replica, batch, self.zo, threads=self.threads, start_step=self.replayed_step)
        except Exception as exc:  # the replica is no longer trustworthy: only a resync repairs it
            self.error = f"replaying steps {batch[0].step}..{batch[-1].step} failed: {exc!r}"
            logger.exception("replay stage stopped")
            with self._progress:
                self._progress.notify_all()
            return False
        self._hooks.after_replay(len(batch))
        per_step = (time.perf_counter() - started) / len(batch)
        self.replay_ema = per_step if self.replay_ema == 0 else 0.8 * self.replay_ema + 0.2 * per_step
        self.last_record = batch[-1]
        with self._progress:
            self.replayed_step += len(batch)
            self._progress.notify_all()
        if self.replayed_step % n == 0 or self.replayed_step == forced:
            self._snapshot(wait=False)
        return True

    def _forced_missing(self) -> bool:
        """The replica stands at a forced step without its image: try again; whether it is still missing."""
        step = self.replayed_step
        if step == 0 or self._forced(step - 1) != step:
            return False
        image = self.ledger.image
        if image is not None and image.step == step:
            return False
        if not self.ledger.writable_now():
            return True  # persistence saves the image before (or a reader gives it back): polled again soon
        return self._snapshot(wait=False) is None and self.snapshot_error is None

    # ------------------------------------------------------------------ images

    def _snapshot(self, wait: bool) -> Image | None:
        """Copy the replica into the image memory and offer it; None when deferred (a second image would break the
        budget)."""
        kind, old = self.ledger.claim(wait=wait)
        if kind == "busy":
            self.snapshots_deferred += 1
            return None
        try:
            buffer = self._memory_for(kind, old, self.layout)
        except MemoryError as exc:
            self.snapshot_error = f"the snapshot of step {self.replayed_step} could not be taken: {exc}"
            self.ledger.unclaim(missing=self.snapshot_error)
            logger.error(self.snapshot_error)
            return None
        self.snapshot_error = None
        self._copy(self.layout.views(buffer.bytes), self.replica, fresh=old is None or buffer is not old.buffer)
        return self._offer(buffer, self.replayed_step)

    def _memory_for(self, kind: str, old: Image | None, layout: ImageLayout) -> ImageBuffer:
        """The claimed image's memory, or new memory where there is none or it is borrowed (never written again)."""
        if kind == "reuse" and old.layout == layout:
            return old.buffer
        if old is not None:
            old.buffer.close()
            self.budget.add("image", -old.buffer.nbytes)
        buffer = image_memory(layout.nbytes, self._name)
        self.budget.add("image", buffer.nbytes)
        return buffer

    def _offer(self, buffer: ImageBuffer, step: int) -> Image:
        hold = self._hold_forced and step > 0 and self._forced(step - 1) == step
        image = Image(step, buffer, self.layout, next(self._tokens), hold=hold)
        self.ledger.publish(image)
        self.snapshots_taken += 1
        self._on_image(image)
        return image

    def _copy(self, dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], fresh: bool) -> None:
        started = time.perf_counter()
        threads = self.threads or 1
        copy_state(dst, src, threads=threads)
        self.last_copy_seconds = time.perf_counter() - started
        self.last_copy_bytes = self.layout.nbytes
        self.last_copy_fresh, self.last_copy_threads = fresh, threads
        if not fresh:
            self.touched_copies.append(self.last_copy_seconds)

    # ------------------------------------------------------------------ commands (run on the thread)

    def open_intake(self, layout: ImageLayout, timeout: float = 300.0) -> ImageBuffer:
        """Memory for a trainer's state of `layout`, taken from the image's (no image is offered meanwhile)."""
        if self.intake is not None and self._intake_layout == layout:
            return self.intake  # a second request (the first writer was lost): the same memory
        if self.intake is not None:
            self.abort_intake()
        # A trainer's state replaces the replica: a held image not yet durable is given up for it.
        kind, old = self.ledger.claim(wait=True, timeout=timeout, over_hold=True)
        self.intake, self._intake_layout = self._memory_for(kind, old, layout), layout
        return self.intake

    def commit_intake(self, step: int, source: str) -> Image:
        """The intake holds the state at `step`: it becomes the replica and the newest image."""
        if self.intake is None:
            raise StageError("no intake is open: a trainer's state is written into one first")
        buffer, layout = self.intake, self._intake_layout
        self.intake = self._intake_layout = None
        return self.adopt(buffer, layout, step, source)

    def abort_intake(self) -> None:
        """Give the intake's memory back: a snapshot of the replica, where there is one."""
        if self.intake is None:
            return
        buffer, self.intake, self._intake_layout = self.intake, None, None
        if self.replica is not None and buffer.nbytes == self.layout.nbytes:
            self._copy(self.layout.views(buffer.bytes), self.replica, fresh=False)  # the intake's, not allocated for it
            self._offer(buffer, self.replayed_step)
        else:
            buffer.close()
            self.budget.add("image", -buffer.nbytes)
            self.ledger.unclaim()

    def adopt(self, buffer: ImageBuffer, layout: ImageLayout, step: int, source: str) -> Image:
        """`buffer` holds the state at `step`: the replica becomes a copy of it, and it the newest image."""
        rebuilt = self.layout != layout
        if rebuilt:
            if self.replica is not None:
                logger.warning("the state's layout changed: the replica is rebuilt")
            self.replica = self._replica_memory = None
            self.budget.set("replica", 0)
            flat, self._replica_memory = anonymous_buffer(layout.nbytes)
            self.budget.set("replica", layout.nbytes)
            self.replica, self.layout = layout.views(flat), layout
        if source != "resync":
            self.ledger.reset(step)  # a fresh or durable replica: the records start here
        else:
            if self.ledger.next_step < step:  # records the shadow never got: the ledger (and log) restart there
                logger.warning("resync to step %d beyond the records received (%d): the log restarts there",
                               step, self.ledger.next_step)
                self.ledger.reset(step)
            self.resync_count += 1
        self._copy(self.replica, layout.views(buffer.bytes), fresh=rebuilt)
        self.source, self.error = source, None
        with self._progress:
            self.replayed_step = step
            self._progress.notify_all()
        return self._offer(buffer, step)

    def snapshot_now(self, step: int) -> Image:
        """The image at `step`, where the replica is; taken unless the newest one is it."""
        if self.replayed_step != step:
            raise StageError(f"the replica is at step {self.replayed_step}, not {step}")
        image = self.ledger.image
        if image is not None and image.step == step:
            return image
        image = self._snapshot(wait=True)
        if image is None:
            raise StageError(self.snapshot_error or f"the snapshot of step {step} could not be taken")
        return image

    def snapshot_caught_up(self) -> Image | None:
        """For a recovering trainer: replay what was received, then snapshot the replica, so that the trainer copies
        a state and replays nothing; None where the replica replayed nothing past the newest image, cannot catch
        up, or the image's memory is busy. It takes every replay thread: the trainer waits for it."""
        image = self.ledger.image
        if image is None or self.replayed_step <= image.step or not self.ledger.writable_now():
            return None  # (pinned now: no catch-up whose snapshot could not be taken)
        threads = self.threads
        self.threads = max(threads or 1, default_threads())
        try:
            while self.replayed_step < self.ledger.next_step and self._replay_batch():
                pass  # (a batch ends at a snapshot boundary, and may take that snapshot)
            image = self.ledger.image
            if (self.replica is None or self.error is not None or self.replayed_step != self.ledger.next_step
                    or image is None or image.step >= self.replayed_step):
                return None
            image = self._snapshot(wait=False)
        finally:
            self.threads = threads
        if image is not None:
            self.recovery_snapshots += 1
        return image

    def profile_replay(self, threads: int) -> float | None:
        """Seconds to replay the newest record with `threads` threads on the whole replica, estimated on a scratch
        copy of part of it."""
        record = self.last_record
        if record is None:
            return None
        if self._scratch is None:
            self._scratch = ProfileScratch(self.replica, self.zo)
            self.budget.set("scratch", self._scratch.bytes)
        scratch, record = self._scratch.state, self._scratch.record_for(record)
        # the same record twice, on purpose: the step is the record's
        replay(scratch, [record], self.zo, threads=threads, start_step=record.step)  # untimed: loads the kernel
        started = time.perf_counter()
        replay(scratch, [record], self.zo, threads=threads, start_step=record.step)
        return (time.perf_counter() - started) / self._scratch.fraction

    def profile_snapshot(self) -> float:
        if self.last_copy_seconds is None:
            raise StageError("no copy between the replica and an image has been timed yet")
        return self.last_copy_seconds

    def end_profile(self, threads: int, snapshot_interval: int) -> None:
        self._scratch = None
        self.budget.set("scratch", 0)
        self.threads, self.snapshot_interval = threads, snapshot_interval

    def replica_hash(self) -> tuple[int, str]:
        return self.replayed_step, state_hash(self.replica)

    def close(self) -> None:
        """Let go of the image memory; borrowers keep what they opened."""
        image = self.ledger.image
        for buffer in (image.buffer if image is not None else None, self.intake):
            if buffer is not None:
                buffer.close()


SCRATCH_BYTES = 64 << 20
"""The most the startup profile copies of the replica."""
SCRATCH_SHARE = 32
"""Nor more than 1/32 of the state, so that the scratch stays small beside the budget of two copies."""


SCRATCH_MIN = 64 << 10
"""But 64 KiB at least: a replay's fixed cost, scaled up, would swamp a small state's profile."""


def scratch_limit(state_bytes: int) -> int:
    """The profile's scratch bytes for a state of `state_bytes`: 1/32 of it, within [64 KiB, 64 MiB]."""
    return min(SCRATCH_BYTES, max(SCRATCH_MIN, state_bytes // SCRATCH_SHARE))


class ProfileScratch:
    """A copy of the replica's leading parameters, `scratch_limit` bytes at most, to time replays on (large
    tensors cut along their first dimension, keeping their weight decay); `fraction` scales a timing up."""

    def __init__(self, replica: dict[str, torch.Tensor], zo: ZOConfig):
        moments = moment_prefixes(zo.optimizer)
        names = [n for n in replica if not n.startswith(ALL_MOMENT_PREFIXES)]
        total = sum(replica[n].numel() for n in names)
        limit = scratch_limit(sum(t.numel() * t.element_size() for t in replica.values()))
        params, taken, elements = {}, 0, 0
        for name in names:
            if taken >= limit:
                break
            t = replica[name]
            per_element = t.element_size() + 4 * len(moments)  # moments are float32
            row = max(1, t[0].numel()) if t.dim() else 1
            rows = t.shape[0] if t.dim() else 1
            keep = min(rows, (limit - taken) // (per_element * row))
            if keep == 0:
                if params:
                    break  # the limit holds: not one more row
                keep = 1  # a state whose first row is over the limit is timed on that row
            params[name] = (t[:keep] if t.dim() else t).clone()
            taken += params[name].numel() * per_element
            elements += params[name].numel()
        self.state = dict(params)
        for prefix in moments:
            for name, p in params.items():
                self.state[prefix + name] = replica[prefix + name][: p.shape[0] if p.dim() else None].clone()
        self.bytes = sum(t.numel() * t.element_size() for t in self.state.values())
        self.fraction = elements / max(total, 1)
        self._fingerprint = Layout.from_state(self.state, zo).fingerprint(zo)
        self._params = len(params)

    def record_for(self, record: StepRecord) -> StepRecord:
        return dataclasses.replace(record, fingerprint=self._fingerprint, extras=record.extras[: self._params])


# ---------------------------------------------------------------------------------------- persist
