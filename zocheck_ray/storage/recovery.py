"""`recover`: the newest exact state that durable storage can rebuild.

    state, step = recover_state("s3://bucket/run", storage_options=opts)
    result = recover("s3://bucket/run", storage_options=opts)   # and how: snapshot, records, problems

The newest snapshot that loads with every hash intact, plus the durable log records
after it replayed with the core's fused kernel: the state the trainer had after step
`step - 1`, bit for bit. A corrupt snapshot is reported by name and the next older
one is used; a corrupt log segment is reported by name and the records before it are
used. Both only move the image back in time: a deterministic trainer recomputes the
steps in between exactly, so no number changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping

import torch
from pydantic import ValidationError

from zocheck_ray.core import ZOConfig, replay
from zocheck_ray.storage.errors import CorruptLogError, CorruptSnapshotError, SnapshotNotFoundError, StorageError
from zocheck_ray.storage.snapshot import SnapshotInfo, SnapshotMeta, SnapshotStore
from zocheck_ray.storage.steplog import StepLog, read_log, read_records

logger = logging.getLogger(__name__)


@dataclass
class RecoveredState:
    """A recovered state and how it was obtained."""

    state: dict[str, torch.Tensor]
    step: int
    """The step the state is at: the next step to run (snapshot step + records replayed)."""
    snapshot: SnapshotInfo
    meta: SnapshotMeta
    config: ZOConfig
    records_replayed: int
    problems: list[str] = field(default_factory=list)
    """What was skipped on the way (corrupt snapshots, a damaged log segment), by name."""


def recover(snapshots: SnapshotStore | str, log: StepLog | str | None = None, *, storage_options: dict | None = None,
            config: ZOConfig | None = None, threads: int | None = None,
            out: Mapping[str, torch.Tensor] | None = None) -> RecoveredState:
    """Rebuild the newest exact state from a snapshot store and the step log.

    `snapshots` is a store or its URL (the run's root); `log` a `StepLog` or URL, by
    default the same root. `config` overrides the ZO config saved in the manifest.
    `out`: CPU tensors of the snapshot's layout to read and replay into (the one copy of the
    state this takes; without it, one is allocated).
    """
    store = snapshots if isinstance(snapshots, SnapshotStore) else SnapshotStore(
        snapshots, storage_options, create=False)
    problems: list[str] = []
    infos = store.committed()
    if not infos:
        raise SnapshotNotFoundError(f"no committed snapshot under {store.url}: nothing to recover from")
    for info in infos:
        try:
            state, meta = store.load(info, out=out)
        except CorruptSnapshotError as exc:
            logger.warning("snapshot at step %d is unusable, trying an older one: %s", info.step, exc)
            problems.append(str(exc))
            continue
        zo_config = config if config is not None else _config_of(info, meta)
        records = _records(store, log, storage_options, info.step, problems)
        replay(state, records, zo_config, threads=threads, start_step=info.step)
        return RecoveredState(state, info.step + len(records), info, meta, zo_config, len(records), problems)
    raise CorruptSnapshotError(f"every committed snapshot under {store.url} is corrupt: {'; '.join(problems)}",
                               store.url)


def recover_state(snapshots: SnapshotStore | str, log: StepLog | str | None = None, *,
                   storage_options: dict | None = None, config: ZOConfig | None = None,
                   threads: int | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """`(state, step)`: the newest valid snapshot plus the replayed log suffix (see `recover`)."""
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

