"""`StepLog`: the durable log of step records, so a host failure loses no logged step.

    log = StepLog("s3://bucket/run", seal_records=4096, seal_seconds=60)
    log.append(record)          # buffered
    log.flush()                 # durable: fsync locally; on S3, seals and uploads the segment
    records = read_log("s3://bucket/run", after_step=snapshot.step - 1)

Segments under `<url>/log/` (`segments.py`) are sealed by record count or age. Reading tolerates a
torn tail only where one can happen, at the end of a local open segment; anything else is
corruption, reported with the segment's URL.

`durable_step` moves only once the segment is seen at its path as written, and `confirm` rechecks
every segment the log vouches for, so a log lost under the writer raises `StorageLostError` and is
never reported durable.
"""

from __future__ import annotations

import logging
import time

from zocheck_ray.core import RecordSequenceError, StepRecord
from zocheck_ray.storage.errors import CorruptLogError, ObjectNotFoundError, StorageError, StorageLostError
from zocheck_ray.storage.fs import Storage, Written, open_storage
from zocheck_ray.storage.lease import Lease, check_lease_for, require_lease
from zocheck_ray.storage.steplog.segments import LOG_DIR, SEGMENT_MAGIC, list_segments, parse_segment, segment_writer

logger = logging.getLogger(__name__)

AUTO_SEAL_RETRY_SECONDS = 5.0


def read_log(url: str, after_step: int, storage_options: dict | None = None) -> list[StepRecord]:
    """The contiguous records after `after_step`; stops at a gap, raises `CorruptLogError` naming a damaged segment."""
    _check_after_step(after_step)
    return read_records(open_storage(url, storage_options, create=False), after_step)


def _check_after_step(after_step: int) -> None:
    if isinstance(after_step, bool) or not isinstance(after_step, int) or after_step < -1:
        raise ValueError(f"after_step must be an integer >= -1, got {after_step!r}")


LISTING_ATTEMPTS = 5
"""How often `read_records` lists the log again when a listed segment went before it was read."""


def read_records(storage: Storage, after_step: int) -> list[StepRecord]:
    """`read_log` on an opened `Storage`, listing again where a live writer sealed or collected a segment."""
    _check_after_step(after_step)
    for _ in range(LISTING_ATTEMPTS - 1):
        try:
            return _read_listed(storage, after_step)
        except ObjectNotFoundError:
            pass
    return _read_listed(storage, after_step)  # the last attempt raises what it meets


def _read_listed(storage: Storage, after_step: int) -> list[StepRecord]:
    segments = list_segments(storage)
    out: list[StepRecord] = []
    for i, seg in enumerate(segments):
        expected = after_step + 1 + len(out)
        following = segments[i + 1] if i + 1 < len(segments) else None
        if following is not None and following.first_step <= expected:
            continue  # wholly before the records asked for
        url = storage.url_of(seg.rel)
        try:
            records, _ = parse_segment(storage.read_bytes(seg.rel), seg, url,
                                       torn_tail_ok=not seg.sealed and following is None)
        except CorruptLogError as exc:
            _extend(out, exc.records, after_step, storage.url)
            exc.records = out
            raise
        if not _extend(out, records, after_step, storage.url):
            break
    return out


def _extend(out: list[StepRecord], records: list[StepRecord], after_step: int, url: str) -> bool:
    """Append the records continuing `out`; False (with a warning) at a gap."""
    for record in records:
        expected = after_step + 1 + len(out)
        if record.step < expected:
            continue
        if record.step > expected:
            logger.warning("log %s has a gap: step %d is missing, records from step %d on are not used",
                           url, expected, record.step)
            return False
        out.append(record)
    return True


class StepLog:
    """Append-only, segmented, CRC'd log of `StepRecord`s under `<url>/log/`; one writer, not thread-safe.

    Opening repairs a torn local segment and continues after the last durable step, or from `resume_step`
    (a deterministic trainer regenerates what it drops). `auto_seal=False` keeps every write out of `append`,
    so a slow store never blocks the appending thread."""

    def __init__(self, url: str, storage_options: dict | None = None, *, seal_records: int = 4096,
                 seal_seconds: float = 60.0, fsync: bool = True, resume_step: int | None = None,
                 lease: Lease | None = None, auto_seal: bool = True):
        if isinstance(seal_records, bool) or not isinstance(seal_records, int) or seal_records < 1:
            raise ValueError(f"seal_records must be a positive integer, got {seal_records!r}")
        if not seal_seconds > 0:
            raise ValueError(f"seal_seconds must be > 0, got {seal_seconds!r}")
        if resume_step is not None and (isinstance(resume_step, bool) or not isinstance(resume_step, int)
                                        or resume_step < 0):
            raise ValueError(f"resume_step must be a non-negative integer, got {resume_step!r}")
        self.seal_records = seal_records
        self.auto_seal = bool(auto_seal)
        """False: `append` only buffers; `flush` seals what is due."""
        self.seal_seconds = float(seal_seconds)
        self.fsync = bool(fsync)
        self.storage = open_storage(url, storage_options, create=True)
        self.url = self.storage.url
        check_lease_for(lease, self.storage)
        self.lease = lease
        self.storage.make_dirs(LOG_DIR)
        self.storage.sync_dir("")
        self._writer = segment_writer(self.storage, self.fsync)
        self._buffer = bytearray()         # appended, not yet handed to the writer
        self._segment_first: int | None = None
        self._segment_records = 0
        self._segment_started = 0.0
        self._next_auto_seal = 0.0         # after a failed automatic seal, when to try again
        self._repair()
        last = self._truncate_from(resume_step) if resume_step is not None else self._last_durable_step()
        self.durable_step: int | None = last
        """The last step known durable (None if empty): its segment was seen at its path as written."""
        self._next_step: int | None = resume_step if resume_step is not None else (None if last is None else last + 1)
        self._kept: dict[int, tuple[Written, int]] = self._found(last)
        """first step -> (the segment as written or found at open, its last step): what the log vouches for."""

    def __repr__(self) -> str:
        return f"StepLog({self.url!r}, seal_records={self.seal_records}, fsync={self.fsync})"

    def __enter__(self) -> "StepLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def next_step(self) -> int | None:
        """The step the next `append` must carry (None before the first append to an empty log)."""
        return self._next_step

    # ------------------------------------------------------------------ appending

    def append(self, record: StepRecord) -> None:
        """Buffer one record (durable after `flush` or a seal)."""
        if self._next_step is not None and record.step != self._next_step:
            raise RecordSequenceError(f"step log {self.url} expects step {self._next_step}, got step {record.step} "
                                      "(records are appended in order, without gaps or repeats)")
        if self._segment_first is None:
            self._segment_first = record.step
            self._segment_started = time.monotonic()
        self._buffer += record.to_bytes()
        self._segment_records += 1
        self._next_step = record.step + 1
        if not self.auto_seal:
            return
        now = time.monotonic()
        if (self._segment_records >= self.seal_records or now - self._segment_started >= self.seal_seconds) \
                and now >= self._next_auto_seal and (self.lease is None or self.lease.held):
            # (A lost lease is reported by the next flush or seal, not by an append.)
            try:
                self.seal()
            except StorageError as exc:
                # Accepted and kept buffered; an explicit flush or seal reports the failure, and appends stay cheap.
                self._next_auto_seal = now + min(self.seal_seconds, AUTO_SEAL_RETRY_SECONDS)
                logger.warning("could not seal a segment of %s, will retry: %s", self.url, exc)

    def flush(self) -> None:
        """Locally: write and fsync every appended record. On an object store: seal the segment if it is due, so a
        run makes few objects."""
        check_lease_for(self.lease, self.storage)
        if self._writer.appends and self._buffer:
            self._append()
        if self._segment_first is None:
            return
        aged = time.monotonic() - self._segment_started >= self.seal_seconds
        # Where records are durable only once sealed, a full segment is sealed as well.
        if aged or (not self._writer.appends and self._segment_records >= self.seal_records):
            self.seal()

    def _append(self) -> None:
        try:
            written = self._writer.append(self._segment_first, self._buffer)
        except StorageLostError as exc:
            raise self._lost(exc) from exc
        self._buffer.clear()
        self._kept[self._segment_first] = (written, self._next_step - 1)
        self.durable_step = self._next_step - 1

    def seal(self) -> None:
        """Close the current segment for good: rename it locally, upload it elsewhere."""
        if self._segment_first is None:
            return
        check_lease_for(self.lease, self.storage)
        if self._writer.appends and self._buffer:
            self._append()  # so that a seal retried after a failed rename appends nothing twice
        try:
            written = self._writer.seal(self._segment_first, self._buffer)
        except StorageLostError as exc:
            raise self._lost(exc) from exc
        self._buffer.clear()
        self._kept[self._segment_first] = (written, self._next_step - 1)
        self.durable_step = self._next_step - 1
        self._segment_first = None
        self._segment_records = 0

    def confirm(self) -> None:
        """Check that every segment this log wrote or found is at its path as written (one listing); else
        `StorageLostError` naming the first one lost and the steps lost."""
        problems = self._problems()
        if problems:
            raise self._lost(None, problems)

    def _problems(self) -> list[tuple[str, str, int, int]]:
        """(url, what is wrong, first step, last step) of each segment not as written."""
        found = self.storage.observe_dir(LOG_DIR)
        out = []
        for first, (written, last) in sorted(self._kept.items()):
            problem = written.changed(found.get(written.rel.rsplit("/", 1)[-1]))
            if problem is not None:
                out.append((self.storage.url_of(written.rel), problem, first, last))
        return out

    def _lost(self, exc: StorageLostError | None, problems: list | None = None) -> StorageLostError:
        """One error for what the log lost: the first path and every step lost (from a listing)."""
        try:
            problems = problems if problems is not None else self._problems()
        except StorageError:
            problems = []
        if not problems and exc is not None:  # (the open segment, whose records may not be kept yet)
            first = self._segment_first if self._segment_first is not None else self._next_step
            problems = [(exc.url or self.url, str(exc).removeprefix(f"{exc.url} "), first, self._next_step - 1)]
        url, problem, _, _ = problems[0]
        ranges: list[list[int]] = []
        for _, _, first, last in problems:
            if ranges and first == ranges[-1][1] + 1:
                ranges[-1][1] = last
            else:
                ranges.append([first, last])
        steps = ", ".join(f"{a}..{b}" for a, b in ranges)
        return StorageLostError(f"the durable step log lost steps {steps}: {url} {problem}", url)

    def close(self) -> None:
        """Seal what was appended; the log can be reopened later to continue."""
        self.seal()

    # ------------------------------------------------------------------ reading and cleanup

    def read(self, after_step: int) -> list[StepRecord]:
        """The contiguous durable records after `after_step` (see `read_log`)."""
        return read_records(self.storage, after_step)

    def collect_garbage(self, keep_from_step: int) -> list[str]:
        """Delete sealed segments holding only steps before `keep_from_step` (the oldest retained snapshot's)."""
        check_lease_for(self.lease, self.storage)
        removed = []
        segments = list_segments(self.storage)
        for seg, following in zip(segments, segments[1:]):
            if seg.sealed and following.first_step <= keep_from_step:
                self._kept.pop(seg.first_step, None)  # no longer vouched for before it goes
                self.storage.remove(seg.rel)
                removed.append(self.storage.url_of(seg.rel))
        if removed:
            self.storage.sync_dir(LOG_DIR)
        return removed

    # ------------------------------------------------------------------ opening

    def _found(self, last: int | None) -> dict[int, tuple[Written, int]]:
        """The segments found at open, as they are now (one listing), with their last steps."""
        found = self.storage.observe_dir(LOG_DIR)
        segments = list_segments(self.storage)
        kept = {}
        for seg, following in zip(segments, [*segments[1:], None]):
            end = following.first_step - 1 if following is not None else last
            written = found.get(seg.rel.rsplit("/", 1)[-1])
            if written is not None and end is not None and end >= seg.first_step:
                kept[seg.first_step] = (written, end)
        return kept

    def _repair(self) -> None:
        """Seal a local open segment a crash left behind, without its torn tail."""
        for seg in list_segments(self.storage):
            if seg.sealed:
                continue
            url = self.storage.url_of(seg.rel)
            require_lease(self.lease, self.storage,
                          f"repair {url} (an open segment: a crashed writer's, or a live writer's)")
            records, valid = parse_segment(self.storage.read_bytes(seg.rel), seg, url, torn_tail_ok=True)
            self._writer.repair(seg, valid, len(records))
            if records:
                logger.info("sealed %s left open by an earlier writer (%d records)", url, len(records))

    def _last_durable_step(self) -> int | None:
        for seg in reversed(list_segments(self.storage)):
            url = self.storage.url_of(seg.rel)
            try:
                records, _ = parse_segment(self.storage.read_bytes(seg.rel), seg, url, torn_tail_ok=False)
            except CorruptLogError as exc:
                raise CorruptLogError(f"{exc} -- to continue, open the log with resume_step set to the step the "
                                      "recovered state is at; the damaged records are then dropped", url,
                                      exc.records, exc.step, exc.offset) from exc
            if records:
                return records[-1].step
        return None

    def _truncate_from(self, resume_step: int) -> int | None:
        """Drop logged records at or after `resume_step` (and any damage); returns the last step kept."""
        last = None
        for seg in reversed(list_segments(self.storage)):  # newest first, so a crash leaves a prefix
            if seg.first_step >= resume_step:
                require_lease(self.lease, self.storage, f"drop the logged records from step {resume_step} on")
                self.storage.remove(seg.rel)
                continue
            url = self.storage.url_of(seg.rel)
            damaged = False
            try:
                records, _ = parse_segment(self.storage.read_bytes(seg.rel), seg, url, torn_tail_ok=False)
            except CorruptLogError as exc:
                records, damaged = exc.records, True
                logger.warning("dropping the damaged end of %s: %s", url, exc)
            kept = [r for r in records if r.step < resume_step]
            if not kept or damaged or len(kept) != len(records):
                require_lease(self.lease, self.storage, f"drop the logged records from step {resume_step} on"
                              if not damaged else f"cut the damaged end of {url}")
            if not kept:
                self.storage.remove(seg.rel)
                continue
            if damaged or len(kept) != len(records):
                self.storage.write_atomic(seg.rel, SEGMENT_MAGIC + b"".join(r.to_bytes() for r in kept))
            last = kept[-1].step
            break
        self.storage.sync_dir(LOG_DIR)
        return last
