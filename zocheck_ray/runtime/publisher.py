"""The trainer's side of the record stream: ordered sends, acknowledgements, re-sends.

The training loop only appends a record to a queue; the publishing thread sends batches and reads
the replies. It keeps every record until the shadow says it is durable, so a restarted shadow gets
what it lacks again. With data-parallel ranks only rank 0 sends; the others hold, so that a
survivor can `deliver` what a dead rank 0 had not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Protocol

import torch

from zocheck_ray.host.image import ImageLayout, copy_state
from zocheck_ray.runtime.messages import PublisherStats, PushReply  # noqa: F401  (PushReply: links return it)
from zocheck_ray.core import StepRecord

logger = logging.getLogger(__name__)

FLUSH_SECONDS = 0.1
"""Records go in batches at most this often, since a push costs both processes CPU; a dying trainer loses at most
this long of unsent steps."""
PING_SECONDS = 0.25
"""With no reply for this long and records not yet durable (or a new step to report), ask."""


class ShadowLink(Protocol):
    """How the trainer reaches its shadow (a Ray actor, or an in-process one in tests)."""

    def borrow_image(self, fresh: bool = False, held: str | None = None):
        """The shadow's newest image opened for reading, or None; `fresh`: a snapshot of the replica where it can take
        one now; `held`: the token of the image the caller holds."""
    def initialize(self, state: dict[str, torch.Tensor], step: int, adapter=None, model_config=None) -> None:
        """Hand the shadow the initial state and the adapter's identity or the model's config."""
    def write_state(self, state: dict[str, torch.Tensor]) -> None:
        """Write `state` into the shadow's intake (a resync follows)."""
    def push(self, data: bytes, trainer_step: int) -> object:
        """Send encoded records (may be empty: a ping); returns a handle to the future reply."""
    def poll(self, handles: list) -> list[tuple[object, PushReply | BaseException]]:
        """The replies (or errors) of the handles that have finished, without waiting."""


class StateOffer:
    """An image that is already a state in this process."""

    def __init__(self, state: dict[str, torch.Tensor], step: int, records: list[StepRecord], source: str,
                 release: Callable[[], None] | None = None, adapter=None):
        self.state, self.step, self.records, self.source = state, step, records, source
        self.adapter = adapter
        self.token = None  # a state of this process's: nothing to recognise it by later
        self.threads = 1  # `copy_into`'s
        self.through = "process"  # no hand-over: the state is here
        self.layout = ImageLayout.of(state)
        self._release = release or (lambda: None)

    def copy_into(self, tensors: dict[str, torch.Tensor]) -> None:
        problem = self.layout.matches(tensors)
        if problem is not None:
            raise ValueError(f"the state does not fit the image: {problem}")
        copy_state(tensors, self.state)

    def release(self) -> None:
        self._release()


def poll_answered(handles: list) -> list:
    """`ShadowLink.poll` for links whose `push` returns the reply itself (in-process shadows)."""
    return [(handle, handle) for handle in handles]


class Publisher:
    """Sends records to the shadow and keeps those not yet durable; one thread drives it (`tick`)."""

    def __init__(self, link: ShadowLink, next_step: int, trainer_step: Callable[[], int],
                 held: list[StepRecord] | tuple = (), publishing: bool = True):
        self.link = link
        self.publishing = publishing
        """False on a data-parallel rank other than 0: records are held, sent only by `deliver`."""
        self._trainer_step = trainer_step
        # One producer, one consumer: the loop only appends, the publishing thread only pops from the left,
        # and deque's append and popleft are atomic: no lock on the loop's path.
        self._pending: deque[StepRecord] = deque()
        self.append: Callable[[StepRecord], None] = self._pending.append
        """The training loop's whole cost of publishing: a deque append."""
        self._held: deque[StepRecord] = deque(held)   # sent, not yet known durable
        self.sent_next = next_step
        self._durable_next = held[0].step if held else next_step
        self._inflight: dict[int, tuple[object, int]] = {}  # push number -> (handle, records sent before it)
        self._pushes = 0
        self._resend_after = -1                       # replies to pushes before this one predate the last re-send
        self._reported_step: int | None = None
        self._last_contact = time.monotonic()
        self._lock = threading.Lock()                 # one sender at a time: batches leave in step order
        self.incarnation: str | None = None
        self.shadow_restarts_seen = 0
        self.resent_records = 0
        self.delivered_records = 0
        """Records handed to the shadow by `deliver` (after a lost rank)."""
        self.errors = 0
        self.last_error: str | None = None
        self.gap: str | None = None
        """Set when the shadow expects a record no longer held: the run restores from the durable state."""

    @property
    def held_records(self) -> int:
        return len(self._held)

    def tick(self) -> None:
        """Send what is pending, take the replies that arrived, re-send or ping if needed."""
        with self._lock:
            self._send_pending()
            if not self.publishing:
                return
            if not self._inflight and time.monotonic() - self._last_contact >= PING_SECONDS and (
                    self._durable_next < self.sent_next or self._reported_step != self._trainer_step()):
                self._send([])
            self._take_replies()

    def flush(self) -> None:
        """Send everything pending now (the end of a segment)."""
        with self._lock:
            self._send_pending()

    def _send_pending(self) -> None:
        batch = []
        while self._pending:
            batch.append(self._pending.popleft())
        if batch:
            self._held.extend(batch)
            self.sent_next = batch[-1].step + 1
            if self.publishing:
                self._send(batch)

    def acknowledge(self, durable_next: int) -> None:
        """Every record before `durable_next` is durable (a holding rank learns it from the controller)."""
        with self._lock:
            if durable_next > self._durable_next:
                self._durable_next = durable_next
                while self._held and self._held[0].step < durable_next:
                    self._held.popleft()

    def deliver(self, timeout: float = 60.0) -> int:
        """Hand the shadow every held record it lacks, so a lost rank leaves no gap; returns the step it then
        expects."""
        with self._lock:
            self._send_pending()
            expected = self._ask([], timeout).next_step  # pushes are answered in order: after those in flight
            missing = [r for r in self._held if r.step >= expected]
            if missing and missing[0].step == expected:
                expected = self._ask(missing, timeout).next_step
                self.delivered_records += len(missing)
            return expected

    def take_over(self) -> int:
        """Become the sending rank: `deliver`, then send every record."""
        expected = self.deliver()
        with self._lock:
            self.publishing = True
        return expected

    def _ask(self, records: list[StepRecord], timeout: float) -> PushReply:
        handle = self.link.push(b"".join(r.to_bytes() for r in records), self._trainer_step())
        deadline = time.monotonic() + timeout
        while True:
            for _, reply in self.link.poll([handle]):
                if isinstance(reply, BaseException):
                    raise reply
                return reply
            if time.monotonic() > deadline:
                raise TimeoutError(f"the shadow did not answer within {timeout:.0f} s")
            time.sleep(0.005)

    def _send(self, records: list[StepRecord]) -> int:
        number = self._pushes
        self._pushes += 1
        step = self._trainer_step()
        try:
            self._inflight[number] = (self.link.push(b"".join(r.to_bytes() for r in records), step), self.sent_next)
        except Exception as exc:  # the next ping finds out what the shadow holds
            self._note_error(f"push failed: {exc!r}")
        self._reported_step = step
        self._last_contact = time.monotonic()
        return number

    def _take_replies(self) -> None:
        if not self._inflight:
            return
        numbers = {id(handle): n for n, (handle, _) in self._inflight.items()}
        for handle, reply in self.link.poll([handle for handle, _ in self._inflight.values()]):
            number = numbers[id(handle)]
            _, expected = self._inflight.pop(number)
            self._last_contact = time.monotonic()
            if isinstance(reply, BaseException):
                self._note_error(f"the shadow did not answer a push: {reply!r}")
                continue
            self._absorb(number, reply, expected)

    def _absorb(self, number: int, reply: PushReply, expected: int) -> None:
        """`expected`: the shadow's next step once this push is in, had nothing been lost."""
        if reply.incarnation != self.incarnation:
            if self.incarnation is not None:
                self.shadow_restarts_seen += 1
                logger.warning("the shadow restarted (it now expects step %d; %d records sent)", reply.next_step,
                               self.sent_next)
            self.incarnation = reply.incarnation
        if reply.durable_next > self._durable_next:
            self._durable_next = reply.durable_next
            while self._held and self._held[0].step < self._durable_next:
                self._held.popleft()
        if reply.next_step < expected and number > self._resend_after:
            self._resend_from(reply.next_step)

    def _resend_from(self, step: int) -> None:
        if not self._held or self._held[0].step > step:
            first = self._held[0].step if self._held else self.sent_next
            self.gap = (f"the shadow expects step {step} but the trainer holds records from step {first} on: "
                        f"no process holds the records of steps {step}..{first - 1}")
            logger.error(self.gap)
            return
        records = [r for r in self._held if r.step >= step]
        logger.warning("re-sending %d records (steps %d..%d) the shadow lacks", len(records), records[0].step,
                       records[-1].step)
        self.resent_records += len(records)
        self._resend_after = self._send(records)

    def _note_error(self, message: str) -> None:
        self.errors += 1
        self.last_error = message
        logger.warning(message)

    def clear_gap(self, step: int) -> None:
        """After a resync at `step`: the shadow holds everything before it."""
        with self._lock:
            self.gap = None
            self._resend_after = self._pushes - 1

    def stats(self) -> PublisherStats:
        return PublisherStats(held_records=len(self._held), resent_records=self.resent_records,
                              delivered_records=self.delivered_records, shadow_restarts_seen=self.shadow_restarts_seen,
                              publish_errors=self.errors, last_publish_error=self.last_error, gap=self.gap)
