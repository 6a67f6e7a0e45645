"""Durable storage: crash-consistent snapshots and a step log over fsspec (local disk, S3).

    from zocheck_ray.storage import SnapshotStore, StepLog, recover_state

    lease = Lease("s3://bucket/run", {"endpoint_url": url}, owner="shadow:run-1")
    lease.acquire(); lease.start_heartbeat()            # one writer per run
    store = SnapshotStore("s3://bucket/run", storage_options={"endpoint_url": url}, lease=lease)
    log = StepLog("s3://bucket/run", {"endpoint_url": url}, lease=lease)
    log.append(record); log.flush()                     # every step, buffered
    store.save(step, state, {"zo_config": config})      # every N steps
    log.collect_garbage(store.committed()[-1].step)     # after a save
    state, step = recover_state("s3://bucket/run")      # after a host failure

Storage knows nothing of training: it handles tensors, `StepRecord`s and JSON metadata.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zocheck_ray.core.lazy import on_first_use

if TYPE_CHECKING:
    from zocheck_ray.storage.errors import (
        CorruptLogError,
        CorruptSnapshotError,
        RulesVersionError,
        SnapshotNotFoundError,
        StorageError,
        StorageFullError,
        StorageLostError,
        StorageRefusedError,
        StorageURLError,
    )
    from zocheck_ray.storage.fs import FsspecStorage, Storage, open_storage, parse_url
    from zocheck_ray.storage.lease import (
        Lease,
        LeaseError,
        LeaseHeldError,
        LeaseInfo,
        LeaseLostError,
        LeaseRequiredError,
        check_no_live_writer,
        read_lease,
    )
    from zocheck_ray.storage.recovery import RecoveredState, check_run_rules, recover, recover_state
    from zocheck_ray.storage.audit import Audit, audit_run
    from zocheck_ray.storage.manifest import Manifest, SnapshotMeta
    from zocheck_ray.storage.snapshot import SnapshotInfo, SnapshotStore, snapshot_dir
    from zocheck_ray.storage.steplog import StepLog, read_log


__getattr__, __dir__ = on_first_use(globals(), {
    "errors": (
        "CorruptLogError", "CorruptSnapshotError", "RulesVersionError", "SnapshotNotFoundError", "StorageError",
        "StorageFullError", "StorageLostError", "StorageRefusedError", "StorageURLError",
    ),
    "fs": ("FsspecStorage", "Storage", "open_storage", "parse_url"),
    "lease": (
        "Lease", "LeaseError", "LeaseHeldError", "LeaseInfo", "LeaseLostError", "LeaseRequiredError",
        "check_no_live_writer", "read_lease",
    ),
    "recovery": ("RecoveredState", "check_run_rules", "recover", "recover_state"),
    "audit": ("Audit", "audit_run"),
    "manifest": ("Manifest", "SnapshotMeta"),
    "snapshot": ("SnapshotInfo", "SnapshotStore", "snapshot_dir"),
    "steplog": ("StepLog", "read_log"),
})
"""The names load with their modules on first use: the lease and the file system alone load neither snapshots nor
torch."""
