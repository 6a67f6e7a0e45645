"""`recover`: the newest exact state that durable storage can rebuild.

    state, step = recover_state("s3://bucket/run", storage_options=opts)
    result = recover("s3://bucket/run", storage_options=opts)   # and how: snapshot, records, problems

The newest intact snapshot plus the durable records after it, replayed. A damaged snapshot or log
segment is named and an older state used instead: a deterministic trainer recomputes the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from pydantic import ValidationError

from zocheck_ray.core import ZOConfig, replay
from zocheck_ray.core.record import RULES_VERSION
from zocheck_ray.storage.errors import (
    CorruptLogError, CorruptSnapshotError, RulesVersionError, SnapshotNotFoundError, StorageError,
)
from zocheck_ray.storage.fs import open_storage
from zocheck_ray.storage.snapshot import SNAPSHOTS_DIR, SnapshotInfo, SnapshotMeta, SnapshotStore
from zocheck_ray.storage.steplog import StepLog, read_log, read_records

logger = logging.getLogger(__name__)


@dataclass
class RecoveredState:
    """A recovered state and how it was obtained."""

    state: dict[str, torch.Tensor]
    step: int
    """The step the state is at (the next to run)."""
    snapshot: SnapshotInfo
    meta: SnapshotMeta
    config: ZOConfig
    records_replayed: int
    problems: list[str] = field(default_factory=list)
    """What was skipped on the way, by name."""


def recover(snapshots: SnapshotStore | str, log: StepLog | str | None = None, *, storage_options: dict | None = None,
            config: ZOConfig | None = None, threads: int | None = None,
            out: Mapping[str, torch.Tensor] | None = None,
            pause: Callable[[int, dict[str, torch.Tensor], SnapshotMeta], None] | None = None,
            pause_at: Callable[[int], bool] = lambda step: False) -> RecoveredState:
    """Rebuild the newest exact state from a snapshot store and the step log; `out`: CPU tensors to replay into;
    `pause(step, state, meta)` sees the state at each step `pause_at` names."""
    store = snapshots if isinstance(snapshots, SnapshotStore) else SnapshotStore(
        snapshots, storage_options, create=False)
    problems: list[str] = []
    infos = store.committed()
    if not infos:
        raise SnapshotNotFoundError(f"no committed snapshot under {store.url}: nothing to recover from")
    for info in infos:
        check_rules(info)
        try:
            state, meta = store.load(info, out=out)
        except CorruptSnapshotError as exc:
            logger.warning("snapshot at step %d is unusable, trying an older one: %s", info.step, exc)
            problems.append(str(exc))
            continue
        zo_config = config if config is not None else _config_of(info, meta)
        records = _records(store, log, storage_options, info.step, problems)
        position = info.step
        for step in range(info.step + 1, info.step + len(records) + 1):
            if pause is not None and pause_at(step):
                replay(state, records[position - info.step: step - info.step], zo_config, threads=threads,
                       start_step=position)
                pause(step, state, meta)
                position = step
        replay(state, records[position - info.step:], zo_config, threads=threads, start_step=position)
        return RecoveredState(state, info.step + len(records), info, meta, zo_config, len(records), problems)
    raise CorruptSnapshotError(f"every committed snapshot under {store.url} is corrupt: {'; '.join(problems)}; "
                               "nothing was deleted: restore the damaged files from a copy, or start the job under "
                               "another run_id or storage", store.url)


def check_rules(info: SnapshotInfo) -> None:
    """Refuse a snapshot of other update rules."""
    found = info.manifest.rules_version
    if found != RULES_VERSION:
        raise RulesVersionError(
            f"{info.url} was made under zocheck-ray's update rules version {found}, and this zocheck-ray applies "
            f"version {RULES_VERSION}: replaying its log would reach another state. Finish or recover that run with "
            f"the zocheck-ray release that made it, or start a new run under another storage path")


def check_run_rules(url: str, storage_options: dict | None = None) -> None:
    """`check_rules` on a run's newest snapshot, if any."""
    if SNAPSHOTS_DIR not in open_storage(url, storage_options, create=False).list_dir(""):
        return  # a new run
    latest = SnapshotStore(url, storage_options, create=False).latest()
    if latest is not None:
        check_rules(latest)


def recover_state(snapshots: SnapshotStore | str, log: StepLog | str | None = None, *,
                   storage_options: dict | None = None, config: ZOConfig | None = None,
                   threads: int | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """`(state, step)` of `recover`."""
    result = recover(snapshots, log, storage_options=storage_options, config=config, threads=threads)
    return result.state, result.step


def _config_of(info: SnapshotInfo, meta: SnapshotMeta) -> ZOConfig:
    if meta.zo_config is None:
        raise StorageError(f"{info.url} carries no zo_config; pass config= to replay the log onto it")
    try:
        return ZOConfig.model_validate(meta.zo_config)
    except ValidationError as exc:
        raise StorageError(f"{info.url}: the manifest's zo_config is not a valid ZOConfig: {exc}") from exc


def _records(store: SnapshotStore, log, storage_options, step: int, problems: list[str]):
    try:
        if isinstance(log, StepLog):
            return log.read(after_step=step - 1)
        if log is None:
            # The log lives beside the snapshots, under the same root and credentials.
            return read_records(store.storage, after_step=step - 1)
        return read_log(log, after_step=step - 1, storage_options=storage_options)
    except CorruptLogError as exc:
        logger.warning("step log damaged, recovering to step %d: %s", step + len(exc.records), exc)
        problems.append(str(exc))
        return exc.records

