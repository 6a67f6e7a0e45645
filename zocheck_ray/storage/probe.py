"""`check_writable`: every directory a run writes in takes a write, found before the run starts.

    check_writable("s3://bucket/runs/run-1", {"endpoint_url": url})   # StorageRefusedError naming the directory

Opening a store probes its root only, and each directory a resumed run writes into can refuse on its own.
"""

from __future__ import annotations

from zocheck_ray.storage.fs import open_storage, probe_write
from zocheck_ray.storage.lease import LEASE_DIR
from zocheck_ray.storage.steplog.segments import LOG_DIR
from zocheck_ray.storage.snapshot import SNAPSHOTS_DIR

RUN_DIRS = (SNAPSHOTS_DIR, LOG_DIR, LEASE_DIR)


def check_writable(url: str, storage_options: dict | None = None) -> None:
    """Probe a write at the run's root and in each of its existing directories; raises a `StorageError` naming the
    first that does not take it."""
    storage = open_storage(url, storage_options, create=True)  # the root's probe
    present = set(storage.list_dir(""))
    for directory in RUN_DIRS:
        if directory in present:
            probe_write(storage, directory)
