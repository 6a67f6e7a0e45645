"""`audit_run`: prove a run's durable storage consistent, from what retention kept.

    audit = audit_run("s3://bucket/runs/run-1", storage_options)
    print(audit.describe())   # steps 150..300 proven: 2 snapshots, 150 records, 0 mismatches

Retention collects the log below the oldest kept snapshot, and a recovery from storage leaves a gap
in it; so the audit replays from the oldest snapshot whose log suffix is complete, comparing the
state hash with every later snapshot, every expected step and the final state. Each manifest names
the steps its writer saw durable in the log (`log_first_step..log_last_step`): where the log no
longer holds them, the audit fails and names the steps it cannot prove.
"""

from __future__ import annotations

import time
from typing import Mapping

from pydantic import BaseModel, ConfigDict

from zocheck_ray.core import ZOConfig, replay, state_hash
from zocheck_ray.storage.errors import CorruptLogError, CorruptSnapshotError
from zocheck_ray.storage.recovery import _config_of, check_rules
from zocheck_ray.storage.snapshot import MANIFEST_FILE, SnapshotInfo, SnapshotStore, snapshot_dir
from zocheck_ray.storage.steplog import first_logged_step, read_records


class Audit(BaseModel):
    """What `audit_run` proved about a run's durable storage."""

    model_config = ConfigDict(extra="forbid")

    url: str
    """The run's storage root."""
    verified: bool
    """True when a range was proven and nothing differed or was damaged."""
    first_step: int | None
    """The step of the snapshot the replay started from (None: no usable snapshot)."""
    last_step: int | None
    """The last step whose state was reached by the replay."""
    snapshots_checked: list[int]
    """Steps of the snapshots loaded and compared, the start snapshot first."""
    records_replayed: int
    """Log records replayed from the start snapshot."""
    hashed_steps_checked: int
    """Steps compared with a hash the caller expected."""
    mismatches: list[str]
    """What differed or was damaged, one line each, naming the step range, snapshot or segment."""
    notes: list[str]
    """Why older snapshots were not a start."""
    unproven_steps: list[tuple[int, int]] = []
    """Step ranges a manifest promises in the log (`log_first_step..log_last_step`) that the log does not hold."""
    seconds: float

    def describe(self) -> str:
        """One line: the step range proven, or why not."""
        if self.first_step is None:
            return "nothing proven: " + ("; ".join(self.mismatches) or "no committed snapshot")
        counts = (f"{len(self.snapshots_checked)} snapshot{'s' * (len(self.snapshots_checked) != 1)}, "
                  f"{self.records_replayed} records, {len(self.mismatches)} mismatches")
        if self.verified:
            return f"steps {self.first_step}..{self.last_step} proven: {counts}"
        head = f"steps {self.first_step}..{self.last_step} NOT proven"
        if self.unproven_steps and len(self.mismatches) == len(self.unproven_steps):  # the replay itself matched
            head = (f"steps {self.first_step}..{self.last_step} proven, steps "
                    f"{', '.join(f'{a}..{b}' for a, b in self.unproven_steps)} NOT proven")
        return f"{head}: {counts}: " + "; ".join(self.mismatches)


def audit_run(store: SnapshotStore | str, storage_options: dict | None = None, *,
              expected: Mapping[int, str] | None = None, final_step: int | None = None,
              final_hash: str | None = None, config: ZOConfig | None = None,
              threads: int | None = None) -> Audit:
    """Audit the run rooted at `store` (a `SnapshotStore` or URL). `expected`: step -> the trainer's `state_hash`;
    `final_step`/`final_hash`: the run's end, which the replay must reach and match."""
    started = time.perf_counter()
    store = store if isinstance(store, SnapshotStore) else SnapshotStore(store, storage_options, create=False)
    expected = dict(expected or {})
    if final_step is not None and final_hash is not None:
        expected[final_step] = final_hash
    mismatches: list[str] = []
    notes: list[str] = []
    unproven: list[tuple[int, int]] = []

    def result(first=None, last=None, checked=(), records=0, hashed=0) -> Audit:
        return Audit(url=store.url, verified=first is not None and not mismatches, first_step=first, last_step=last,
                     snapshots_checked=list(checked), records_replayed=records, hashed_steps_checked=hashed,
                     mismatches=mismatches, notes=notes, unproven_steps=unproven,
                     seconds=time.perf_counter() - started)

    infos, damaged = store.scan()
    infos.sort(key=lambda i: i.step)
    mismatches.extend(f"a committed snapshot's manifest is damaged: {exc}" for exc in damaged)
    if not infos:
        mismatches.append(f"no committed snapshot under {store.url}")
        return result()
    unproven.extend(_check_promises(store, infos, mismatches))
    newest = infos[-1]
    end_needed = max(newest.step, final_step if final_step is not None else newest.step)

    for i, start in enumerate(infos):
        records = _log_after_snapshot(store, start, mismatches)
        reach = start.step + len(records)
        if reach < end_needed and start is not newest:
            notes.append(f"the snapshot at step {start.step} is not a start: the log after it ends at step {reach}, "
                         f"before step {end_needed} (collected by retention, or a gap where a recovery resumed)")
            continue
        check_rules(start)  # a replay under other rules would report a mismatch that is no damage
        try:
            state, meta = store.load(start)
        except CorruptSnapshotError as exc:
            mismatches.append(f"the snapshot at step {start.step} is damaged: {exc}")
            continue
        zo_config = config if config is not None else _config_of(start, meta)
        if final_step is not None:
            if reach < final_step:
                mismatches.append(f"the durable log after the snapshot at step {start.step} ends at step {reach}, "
                                  f"before the run's last step {final_step}")
            records = records[:max(0, final_step - start.step)]
        later = {info.step: info for info in infos[i + 1:] if info.step <= start.step + len(records)}
        return _replay_and_compare(store, start, state, records, zo_config, later, expected, threads, mismatches,
                                   result)
    return result()


def _log_after_snapshot(store: SnapshotStore, start: SnapshotInfo, mismatches: list[str]) -> list:
    first = first_logged_step(store.storage)
    if first is None or first > start.step:
        return []  # collected by retention: not a gap to warn about
    return _log_after(store, start.step - 1, mismatches)


def _log_after(store: SnapshotStore, after_step: int, mismatches: list[str]) -> list:
    """The contiguous records after `after_step`; damage met is a mismatch, said once."""
    try:
        return read_records(store.storage, after_step=after_step)
    except CorruptLogError as exc:
        damage = damage_line(exc)
        if damage not in mismatches:  # met again from every later start: said once
            mismatches.append(damage)
        return exc.records


def _check_promises(store: SnapshotStore, infos: list[SnapshotInfo], mismatches: list[str]) -> list[tuple[int, int]]:
    """A mismatch for each manifest, from the oldest kept on, whose promised log steps the log does not hold;
    returns the steps not held."""
    oldest = infos[0].step
    read: dict[int, list] = {}
    unproven = []
    for info in infos:
        first, last = info.manifest.log_first_step, info.manifest.log_last_step
        if first is None or last is None or max(first, oldest) > last:
            continue
        first = max(first, oldest)
        if first not in read:
            read[first] = _log_after(store, first - 1, mismatches)
        held = min(len(read[first]), last - first + 1)
        if held <= last - first:
            url = store.storage.url_of(f"{snapshot_dir(info.step)}/{MANIFEST_FILE}")
            where = "is missing" if not held else f"ends at step {first + held - 1}"
            mismatches.append(f"the log that {url} promises, steps {first}..{last}, {where}: steps "
                              f"{first + held}..{last} cannot be proven")
            unproven.append((first + held, last))
    return unproven


def damage_line(exc: CorruptLogError) -> str:
    """Where the log is damaged: the first unreadable step and the byte of its segment."""
    if exc.step is None:
        return f"the log is damaged: {exc}"
    return (f"the log is damaged at step {exc.step} (byte {exc.offset} of {exc.url}): no record from step "
            f"{exc.step} on is replayed: {exc}")


def _replay_and_compare(store, start, state, records, config, later, expected, threads, mismatches, result):
    checked = [start.step]
    hashed = 0
    anchor = start.step  # the step the current state was last proven or re-loaded at
    diverged = False     # a hashed step since `anchor` already differed
    if start.step in expected:
        hashed += 1
        if start.state_hash != expected[start.step]:
            mismatches.append(f"the snapshot at step {start.step} ({start.url}) differs from the trainer's state "
                              f"at that step")
    end = start.step + len(records)
    stops = sorted({s for s in (*later, *expected) if start.step < s <= end})
    position = start.step
    for stop in stops:
        replay(state, records[position - start.step:stop - start.step], config, threads=threads,
               start_step=position)
        position = stop
        digest = state_hash(state)
        if stop in expected:
            hashed += 1
            if digest != expected[stop] and not diverged:  # later steps of this range differ as a consequence
                diverged = True
                mismatches.append(f"the log replayed from step {anchor} to step {stop} differs from the trainer's "
                                  f"state at step {stop}: a record of steps {anchor}..{stop - 1} was altered")
        if stop in later:
            info = later[stop]
            checked.append(stop)
            try:
                store.check(info)  # its files hashed as they are read back: no second copy of the state
            except CorruptSnapshotError as exc:
                mismatches.append(f"the snapshot at step {stop} is damaged: {exc}")
                continue
            if digest != info.state_hash:
                mismatches.append(f"the log replayed from step {anchor} to step {stop} gives state_hash {digest[:12]}..., "
                                  f"the snapshot at step {stop} ({info.url}) holds {info.state_hash[:12]}...: a record "
                                  f"of steps {anchor}..{stop - 1} or that snapshot was altered")
                store.load(info, out=state)  # check the next range on its own, from that snapshot
            anchor, diverged = stop, False
    if position < end:
        replay(state, records[position - start.step:], config, threads=threads, start_step=position)
    return result(start.step, end, checked, len(records), hashed)
