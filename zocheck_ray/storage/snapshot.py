"""`SnapshotStore`: crash-consistent snapshots of a state, on local disk or an object store.

    store = SnapshotStore("s3://bucket/run", storage_options={"endpoint_url": ...})
    info = store.save(step, state, {"run_id": "r1", "zo_config": config.model_dump(mode="json")})
    tensors, meta = store.load(store.latest())

A snapshot is a directory `snapshots/step-000000001234/` that `from_pretrained` can load, plus
`manifest.json`, which lists every tensor and every file's SHA-256 and is written last: it is the
commit marker. A directory without one is never loaded, and a manifest carries its own checksum,
so a damaged one is never trusted. Retention deletes the manifest first, so a snapshot is
uncommitted before any of its files go; it keeps the newest `keep` and what `retention.json`
pins or holds (storage/retention.py).

`save` returns once the snapshot is seen at its paths as written, and before each commit the
snapshots it committed or found are checked the same way, so a directory lost under the writer
raises `StorageLostError` instead of a commit into its stead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from zocheck_ray.core import state_hash as compute_state_hash
from zocheck_ray.core.hashing import OPTIMIZER_PREFIX, combine_file_digests, dtype_name
from zocheck_ray.core.record import RULES_VERSION
from zocheck_ray.storage.errors import CorruptSnapshotError, SnapshotNotFoundError, StorageError, StorageLostError
from zocheck_ray.storage.fs import PROBE_PREFIX, TMP_MARK, Storage, Written, file_size, open_storage
from zocheck_ray.storage.hf_layout import (
    ADAPTER_CONFIG_FILE, ADAPTER_KIND, HF_CONFIG_FILE, MODEL_INDEX_FILE, file_layout, model_index,
)
from zocheck_ray.storage.lease import Lease, check_lease_for, require_lease
from zocheck_ray.host.localfile import staging_reuse
from zocheck_ray.storage.manifest import FileEntry, Manifest, SnapshotMeta, TensorEntry
from zocheck_ray.storage.retention import RETENTION_FILE, Retention, read_retention
from zocheck_ray.core.dtypes import BY_NAME
from zocheck_ray.storage.tensorfile import CHUNK_BYTES, read_tensors, write_tensors

logger = logging.getLogger(__name__)

SNAPSHOTS_DIR = "snapshots"
MANIFEST_FILE = "manifest.json"
DELETED_DIR = ".deleted-snapshots"
DAMAGED_DIR = "damaged-snapshots"
"""Where a damaged snapshot is moved, out of every reader's way; nothing there is ever loaded or deleted."""
"""Local disk: uncommitted snapshot directories whose files are being deleted."""
_STEP_DIR = re.compile(r"^step-(\d{12,})$")
_HEX_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def snapshot_dir(step: int) -> str:
    """Relative directory of the snapshot at `step`; sorts by step."""
    return f"{SNAPSHOTS_DIR}/step-{step:012d}"


@dataclass(frozen=True)
class SnapshotInfo:
    """A committed snapshot: its step, its URL and its manifest."""

    step: int
    url: str
    manifest: Manifest

    @property
    def state_hash(self) -> str:
        return self.manifest.state_hash


class SnapshotStore:
    """Snapshots under `<url>/snapshots/`, committed by their manifest, newest `keep` retained; one writer.

    Only a store given the run's held `Lease` removes what killed saves left (else an uncommitted
    directory may be another writer's save in flight), and it checks the lease before every commit
    and deletion. `create=False` opens read-only."""

    def __init__(self, url: str, storage_options: dict | None = None, *, keep: int = 2, create: bool = True,
                 lease: Lease | None = None):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 2:
            raise ValueError(f"keep must be an integer >= 2 (one snapshot to load, one to fall back to), got {keep!r}")
        if lease is not None and not create:
            raise ValueError("lease= is for a writer; a store opened with create=False only reads")
        self.keep = keep
        self.storage: Storage = open_storage(url, storage_options, create=create)
        self.url = self.storage.url
        check_lease_for(lease, self.storage)
        self.lease = lease
        self._hashers: ThreadPoolExecutor | None = None
        self._deleter: ThreadPoolExecutor | None = None
        self._deletions: list[Future] = []
        self._deleter_lock = threading.Lock()
        self._vouched: dict[int, dict[str, Written]] = {}
        """step -> its files (manifest included) as written or found: the committed snapshots this writer vouches
        for, checked before each commit (`confirm`)."""
        self._directory: Written | None = None
        """`snapshots/` as found at open (locally its inode)."""
        if create:
            self.storage.make_dirs(SNAPSHOTS_DIR)
            self.storage.sync_dir("")
            if self.storage.local:
                self._directory = self.storage.observe(SNAPSHOTS_DIR)
            if lease is not None:  # without the lease, what looks uncommitted may be another writer's save
                self.clean_uncommitted()
                self.prune()  # a kill between a commit and its retention left one snapshot too many
                for info in self.committed():
                    self._vouch(info)
        else:
            _check_is_root(self.storage)

    def __repr__(self) -> str:
        return f"SnapshotStore({self.url!r}, keep={self.keep})"

    def __enter__(self) -> "SnapshotStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the background deletions and stop idle threads."""
        self.wait_for_deletions()
        with self._deleter_lock:
            for pool in (self._hashers, self._deleter):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._hashers = self._deleter = None

    def _hash_pool(self) -> ThreadPoolExecutor:
        # Kept between saves: starting threads costs a save time on a busy machine.
        with self._deleter_lock:
            if self._hashers is None:
                self._hashers = ThreadPoolExecutor(3, thread_name_prefix="zocheck-snapshot-hash")
            return self._hashers

    # ------------------------------------------------------------------ listing

    def _steps(self) -> list[tuple[int, str]]:
        """(step, directory) of every snapshot directory, newest first."""
        out = []
        for name in self.storage.list_dir(SNAPSHOTS_DIR):
            match = _STEP_DIR.match(name)
            if match:
                out.append((int(match.group(1)), f"{SNAPSHOTS_DIR}/{name}"))
        return sorted(out, reverse=True)

    def _info(self, step: int, directory: str, strict: bool = False) -> SnapshotInfo | None:
        """The snapshot in `directory` if committed with a sound manifest, else None (`strict`: a damaged one
        raises)."""
        rel = f"{directory}/{MANIFEST_FILE}"
        url = self.storage.url_of(rel)
        try:
            data = self.storage.read_bytes(rel)
        except FileNotFoundError:
            return None  # never committed, or being deleted
        try:
            manifest = Manifest.decode(data, url)
            if manifest.step != step:
                raise CorruptSnapshotError(f"{url} says step {manifest.step} but lies in {directory}", url)
        except CorruptSnapshotError as exc:
            if strict:
                raise
            logger.warning("skipping snapshot: %s", exc)
            return None
        return SnapshotInfo(step, self.storage.url_of(directory), manifest)

    def committed(self) -> list[SnapshotInfo]:
        """Every committed snapshot whose manifest is sound, newest first."""
        return [info for step, d in self._steps() if (info := self._info(step, d)) is not None]

    def scan(self) -> tuple[list[SnapshotInfo], list[CorruptSnapshotError]]:
        """`committed()`, plus the damaged manifests it skips."""
        found, damaged = [], []
        for step, directory in self._steps():
            try:
                info = self._info(step, directory, strict=True)
            except CorruptSnapshotError as exc:
                damaged.append(exc)
                continue
            if info is not None:
                found.append(info)
        return found, damaged

    def latest(self) -> SnapshotInfo | None:
        """The newest committed snapshot whose manifest parses, or None."""
        for step, directory in self._steps():
            info = self._info(step, directory)
            if info is not None:
                return info
        return None

    def get(self, step: int) -> SnapshotInfo:
        info = self._info(step, snapshot_dir(step), strict=True)
        if info is None:
            raise SnapshotNotFoundError(f"no committed snapshot at step {step} under {self.url}")
        return info

    # ------------------------------------------------------------------ saving

    def save(self, step: int, tensors: Mapping[str, torch.Tensor],
             meta: SnapshotMeta | Mapping[str, Any] | None = None, *, state_hash: str | None = None,
             hold: bool = False, log_steps: tuple[int, int] | None = None) -> SnapshotInfo:
        """Write a snapshot of `tensors` at `step`, commit it, then prune old ones; returns once it is seen at its
        paths as written. A step committed already with the same state returns unchanged.

        `state_hash`: what the caller expects (a mismatch commits nothing); `hold`: kept until `retention.json`
        releases it; `log_steps`: the (first, last) steps seen durable in the log, promised to `audit_run`."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if log_steps is not None and not (0 <= log_steps[0] <= log_steps[1] < step):
            raise ValueError(f"log_steps must be (first, last) with 0 <= first <= last < step {step}, "
                             f"got {log_steps!r}")
        if state_hash is not None and (not isinstance(state_hash, str) or not _HEX_SHA256.match(state_hash)):
            raise ValueError(f"state_hash must be the 64 lowercase hex digits of zocheck_ray.core.state_hash, "
                             f"got {state_hash!r}")
        meta = meta if isinstance(meta, SnapshotMeta) else SnapshotMeta.model_validate(dict(meta or {}))
        entries = _entries(tensors)
        check_lease_for(self.lease, self.storage)
        self.wait_for_deletions()  # disk holds at most one pruned snapshot besides the kept ones and this one
        directory = snapshot_dir(step)
        leftovers = self.storage.list_dir(directory)
        if MANIFEST_FILE in leftovers and (existing := self._info(step, directory)) is not None:
            if existing.state_hash == (state_hash or compute_state_hash(dict(tensors))):
                try:  # a resumed run snapshots a step again: only sound files make it durable
                    return self._vouch(self.check(existing))
                except CorruptSnapshotError:
                    self.set_aside(step)
                    leftovers = []
            else:
                raise StorageError(f"{existing.url} is already committed with another state (state_hash "
                                   f"{existing.state_hash[:12]}...); a step is snapshotted once")
        if leftovers:
            self.storage.remove_tree(directory)  # a save that never committed (or a damaged manifest)
        try:
            with staging_reuse():  # the files' staging buffers pass from one file to the next, and go after
                info = self._write_and_commit(step, directory, entries, tensors, meta, state_hash, hold, log_steps)
        except BaseException:
            self._remove_torn(directory)
            raise
        self.prune()
        return info

    def _write_and_commit(self, step: int, directory: str, entries: list, tensors: Mapping[str, torch.Tensor],
                          meta: SnapshotMeta, state_hash: str | None, hold: bool,
                          log_steps: tuple[int, int] | None) -> SnapshotInfo:
        self.confirm()  # before make_dirs, which would make a deleted snapshots/ again
        self.storage.make_dirs(directory)
        self.storage.sync_dir(SNAPSHOTS_DIR)
        files, file_of, written = self._write_files(directory, tensors, meta)
        tensor_entries = [TensorEntry(name=n, file=file_of[n], dtype=d, shape=sh, nbytes=b) for n, d, sh, b in entries]
        digest_of_state = _state_hash_of_files(tensor_entries, files)
        if state_hash is not None and state_hash != digest_of_state:
            raise ValueError(f"state_hash {state_hash[:12]}... was given for step {step}, but the tensors hash to "
                             f"{digest_of_state[:12]}...; not committing {self.storage.url_of(directory)}")
        self.storage.sync_dir(directory)
        # Every file must be whole at its path before the manifest may name it, and what is committed already too.
        self._confirm_files(directory, written, f"the snapshot of step {step} being saved")
        self.confirm()

        check_lease_for(self.lease, self.storage)  # a writer that lost the lease commits nothing
        manifest = Manifest(step=step, run_id=meta.run_id, created_unix=time.time(), state_hash=digest_of_state,
                            tensors=tensor_entries,
                            files=files, zo_config=meta.zo_config, user=meta.user, rules_version=RULES_VERSION,
                            held=hold, log_first_step=log_steps[0] if log_steps else None,
                            log_last_step=log_steps[1] if log_steps else None)
        written[MANIFEST_FILE] = self.storage.write_atomic(f"{directory}/{MANIFEST_FILE}", manifest.encode())  # commit
        self._confirm_files(directory, written, f"the snapshot of step {step}, just committed,")
        self._vouched[step] = written
        return SnapshotInfo(step, self.storage.url_of(directory), manifest)

    def confirm(self) -> None:
        """Check that `snapshots/` and every committed snapshot this writer saved or found at open are at their
        paths as written: `StorageLostError` naming the first one that is not."""
        if self._directory is not None:
            problem = self._directory.changed(self.storage.observe(SNAPSHOTS_DIR))
            if problem is not None:
                url = self.storage.url_of(SNAPSHOTS_DIR)
                steps = ", ".join(map(str, sorted(self._vouched))) or "none yet"
                raise StorageLostError(f"the committed snapshots (steps {steps}) are lost: {url} {problem}", url)
        for step, written in sorted(self._vouched.items()):
            self._confirm_files(snapshot_dir(step), written, f"the committed snapshot of step {step}")

    def _confirm_files(self, directory: str, written: dict[str, Written], what: str) -> None:
        found = self.storage.observe_dir(directory)  # one listing
        for name, receipt in sorted(written.items(), key=lambda kv: kv[0] != MANIFEST_FILE):  # the manifest first
            problem = receipt.changed(found.get(name))
            if problem is not None:
                url = self.storage.url_of(receipt.rel)
                raise StorageLostError(f"{what} is lost: {url} {problem}", url)

    def _vouch(self, info: SnapshotInfo) -> SnapshotInfo:
        """Vouch for a committed snapshot found here (not written by this store): its files as they are now."""
        found = self.storage.observe_dir(snapshot_dir(info.step))
        self._vouched[info.step] = {name: found[name] for name in [*info.manifest.files, MANIFEST_FILE]
                                    if name in found}
        return info

    def _remove_torn(self, directory: str) -> None:
        """Remove a failed save's files at once (on a full disk they would starve the log and the lease), unless
        the lease is lost or the manifest was written."""
        if self.lease is not None and not self.lease.held:
            return
        try:
            if MANIFEST_FILE not in self.storage.list_dir(directory):
                self.storage.remove_tree(directory)
        except Exception as exc:  # the save's own error matters more; the store's next open removes it
            logger.warning("could not remove the torn snapshot %s: %s", self.storage.url_of(directory), exc)

    def _write_files(self, directory: str, tensors: Mapping[str, torch.Tensor], meta: SnapshotMeta
                     ) -> tuple[dict[str, FileEntry], dict[str, str], dict[str, Written]]:
        """Write the snapshot's files durably, each shard hashed beside its write; returns the file entries, each
        tensor's file, and each file as written."""
        layout = file_layout(tensors, ADAPTER_KIND if meta.adapter_config is not None else "model")
        files: dict[str, FileEntry] = {}
        receipts: list[Written] = []
        pool = self._hash_pool()
        pending: dict[str, Future] = {}
        try:
            for name, shard in layout.items():  # fsync'd together below, not one after another
                with self.storage.open_write(f"{directory}/{name}", durable=False, written=receipts) as f:
                    pending[name] = write_tensors(f, shard, pool)
            extras = {}
            if meta.hf_config is not None:
                extras[HF_CONFIG_FILE] = json.dumps(meta.hf_config, indent=2, sort_keys=True).encode()
            if meta.adapter_config is not None:
                extras[ADAPTER_CONFIG_FILE] = json.dumps(meta.adapter_config, indent=2, sort_keys=True).encode()
            if (index := model_index(layout)) is not None:
                extras[MODEL_INDEX_FILE] = index
            if clash := sorted(meta.text_files.keys() & (extras.keys() | layout.keys() | {MANIFEST_FILE})):
                raise ValueError(f"text_files may not replace the snapshot's own {clash}")
            extras.update((name, text.encode()) for name, text in meta.text_files.items())
            for name, data in extras.items():
                with self.storage.open_write(f"{directory}/{name}", durable=False, written=receipts) as f:
                    f.write(data)
                files[name] = FileEntry(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
            for name, future in pending.items():
                digest = future.result()
                files[name] = FileEntry(sha256=digest.sha256, size=digest.size)
        finally:  # nothing reads the caller's tensors once save has returned or raised
            wait(list(pending.values()))
        self.storage.make_durable([f"{directory}/{name}" for name in files])
        written = {r.rel.rsplit("/", 1)[-1]: r for r in receipts}
        for name, entry in files.items():  # the bytes the hash counted, and the file's
            if written[name].size != entry.size:
                url = self.storage.url_of(f"{directory}/{name}")
                raise StorageError(f"{url} holds {written[name].size} bytes after its write, not the {entry.size} "
                                   "hashed; not committing")
        return files, {t: name for name, shard in layout.items() for t in shard}, written

    # ------------------------------------------------------------------ loading

    def load(self, which: SnapshotInfo | int, out: Mapping[str, torch.Tensor] | None = None
             ) -> tuple[dict[str, torch.Tensor], SnapshotMeta]:
        """The tensors and metadata of a committed snapshot, every hash verified; `out`: CPU tensors to read into."""
        info = which if isinstance(which, SnapshotInfo) else self.get(which)
        directory = snapshot_dir(info.step)
        manifest = info.manifest
        tensors = _allocate(manifest, out, info.url)
        pool = self._hash_pool()
        for name in dict.fromkeys(e.file for e in manifest.tensors):
            members = {e.name: tensors[e.name] for e in manifest.tensors if e.file == name}
            entry = self._file_entry(manifest, directory, name)
            rel = f"{directory}/{name}"
            url = self.storage.url_of(rel)
            try:
                with self.storage.open_read(rel) as f:
                    digest = read_tensors(f, url, members, file_size(f), pool)
            except FileNotFoundError as exc:
                raise CorruptSnapshotError(f"{url} is missing from a committed snapshot", url) from exc
            if digest.sha256 != entry.sha256 or digest.size != entry.size:
                raise CorruptSnapshotError(f"{url} fails its SHA-256 check (the file is damaged)", url)
        hf_config = adapter_config = None
        text_files = {}
        for name in sorted(manifest.files.keys() - {e.file for e in manifest.tensors}):
            rel = f"{directory}/{name}"
            url = self.storage.url_of(rel)
            data = self._read(rel)
            if hashlib.sha256(data).hexdigest() != manifest.files[name].sha256:
                raise CorruptSnapshotError(f"{url} fails its SHA-256 check (the file is damaged)", url)
            if name == HF_CONFIG_FILE:
                hf_config = json.loads(data)
            if name == ADAPTER_CONFIG_FILE:
                adapter_config = json.loads(data)
            if name not in (HF_CONFIG_FILE, MODEL_INDEX_FILE, ADAPTER_CONFIG_FILE):
                text_files[name] = data.decode()
        if _state_hash_of_files(manifest.tensors, manifest.files) != manifest.state_hash:
            url = self.storage.url_of(f"{directory}/{MANIFEST_FILE}")
            raise CorruptSnapshotError(f"the tensors of {info.url} do not hash to the state_hash in {url}", url)
        meta = SnapshotMeta(run_id=manifest.run_id, zo_config=manifest.zo_config, hf_config=hf_config,
                            adapter_config=adapter_config, user=manifest.user, text_files=text_files)
        return tensors, meta

    def check(self, which: SnapshotInfo | int) -> SnapshotInfo:
        """Every file of a committed snapshot read back and hashed, without loading its tensors."""
        info = which if isinstance(which, SnapshotInfo) else self.get(which)
        directory = snapshot_dir(info.step)
        for name, entry in info.manifest.files.items():
            rel = f"{directory}/{name}"
            url = self.storage.url_of(rel)
            digest, size = hashlib.sha256(), 0
            try:
                with self.storage.open_read(rel) as f:
                    while chunk := f.read(CHUNK_BYTES):
                        digest.update(chunk)
                        size += len(chunk)
            except FileNotFoundError as exc:
                raise CorruptSnapshotError(f"{url} is missing from a committed snapshot", url) from exc
            if digest.hexdigest() != entry.sha256 or size != entry.size:
                raise CorruptSnapshotError(f"{url} fails its SHA-256 check (the file is damaged)", url)
        if _state_hash_of_files(info.manifest.tensors, info.manifest.files) != info.manifest.state_hash:
            url = self.storage.url_of(f"{directory}/{MANIFEST_FILE}")
            raise CorruptSnapshotError(f"the tensors of {info.url} do not hash to the state_hash in {url}", url)
        return info

    def _file_entry(self, manifest: Manifest, directory: str, name: str) -> FileEntry:
        if name not in manifest.files:
            url = self.storage.url_of(f"{directory}/{MANIFEST_FILE}")
            raise CorruptSnapshotError(f"{url} lists tensors in {name} but no hash for it", url)
        return manifest.files[name]

    def _read(self, rel: str) -> bytes:
        try:
            return self.storage.read_bytes(rel)
        except FileNotFoundError as exc:
            url = self.storage.url_of(rel)
            raise CorruptSnapshotError(f"{url} is missing from a committed snapshot", url) from exc

    # ------------------------------------------------------------------ retention and cleanup

    def retention(self) -> Retention:
        """What `retention.json` pins and holds (`storage/retention.py`)."""
        return read_retention(self.storage)

    def set_retention(self, retention: Retention) -> list[int]:
        """Write `retention.json` atomically, then prune; returns the steps removed."""
        check_lease_for(self.lease, self.storage)
        self.storage.write_atomic(RETENTION_FILE, retention.encode())
        return self.prune()

    def prune(self) -> list[int]:
        """Delete all but the newest `keep` committed snapshots and those `retention.json` keeps; returns the
        steps removed."""
        check_lease_for(self.lease, self.storage)
        kept: list[int] = []
        removed, doomed = [], []
        retention = None
        for step, directory in self._steps():
            if len(kept) < self.keep:
                if self._info(step, directory) is not None:
                    kept.append(step)
                continue  # an uncommitted directory newer than a kept snapshot may be a save in flight
            retention = retention or self.retention()
            if step in retention.pins.values():
                continue
            if (info := self._info(step, directory)) is not None and retention.keeps(step, info.manifest.held):
                continue
            # Uncommit first: once the manifest is gone, no reader can pick a half-deleted snapshot.
            self._vouched.pop(step, None)
            self.storage.remove(f"{directory}/{MANIFEST_FILE}")
            if self.storage.local:
                # No file is deleted before the move out of snapshots/ is durable, so after a crash
                # the directory is either whole where it was or gone.
                self.storage.make_dirs(DELETED_DIR)
                doomed.append(f"{DELETED_DIR}/{directory.rsplit('/', 1)[-1]}-{uuid.uuid4().hex[:8]}")
                self.storage.rename(directory, doomed[-1])
            else:
                self.storage.remove_tree(directory)  # an object store cannot move a prefix; deletes are cheap
            removed.append(step)
        if removed:
            self.storage.sync_dir(SNAPSHOTS_DIR)
            logger.info("retention removed snapshots %s under %s (keeping %s)", removed, self.url, kept)
        for rel in doomed:
            self._delete_in_background(rel)
        return removed

    def _delete_in_background(self, rel: str) -> None:
        with self._deleter_lock:
            if self._deleter is None:
                self._deleter = ThreadPoolExecutor(1, thread_name_prefix="zocheck-snapshot-delete")
            self._deletions = [f for f in self._deletions if not f.done()]
            self._deletions.append(self._deleter.submit(self._delete, rel))

    def _delete(self, rel: str) -> None:
        try:
            self.storage.remove_tree(rel)
        except Exception as exc:  # housekeeping: what stays is removed when the store is next opened
            logger.warning("could not delete the pruned snapshot %s: %s", self.storage.url_of(rel), exc)

    def wait_for_deletions(self) -> None:
        """Return once the files of every pruned snapshot are deleted."""
        with self._deleter_lock:
            pending, self._deletions = self._deletions, []
        for future in pending:
            future.result()

    def set_aside(self, step: int) -> str:
        """Move the damaged committed snapshot of `step` to `DAMAGED_DIR`, so no reader counts it durable and the
        step can be written again; returns where it went."""
        check_lease_for(self.lease, self.storage)
        self._vouched.pop(step, None)
        directory = snapshot_dir(step)
        target = f"{DAMAGED_DIR}/{directory.rsplit('/', 1)[-1]}-{time.time_ns()}"
        if self.storage.local:
            self.storage.make_dirs(DAMAGED_DIR)
            self.storage.rename(directory, target)
            self.storage.sync_dir(SNAPSHOTS_DIR)
        else:
            try:
                self.storage.write_atomic(f"{target}/{MANIFEST_FILE}",
                                          self.storage.read_bytes(f"{directory}/{MANIFEST_FILE}"))
            except FileNotFoundError:
                pass
            self.storage.remove(f"{directory}/{MANIFEST_FILE}")
            self.storage.remove_tree(directory)
        logger.warning("the damaged snapshot %s was set aside as %s", self.storage.url_of(directory),
                       self.storage.url_of(target))
        return self.storage.url_of(target)

    def set_aside_newer(self, step: int, keep: frozenset[int] = frozenset()) -> list[str]:
        """`set_aside` every committed snapshot newer than `step` (the one a recovery used), except those at `keep`:
        each was skipped as damaged."""
        return [self.set_aside(s) for s, directory in self._steps()
                if s > step and s not in keep and MANIFEST_FILE in self.storage.list_dir(directory)]

    def clean_uncommitted(self) -> list[str]:
        """Remove what killed saves left (directories without a manifest, temporary files, open uploads), under
        the held lease."""
        require_lease(self.lease, self.storage, "remove uncommitted snapshots")
        removed = []
        for _, directory in self._steps():
            names = self.storage.list_dir(directory)
            if MANIFEST_FILE not in names:
                self.storage.remove_tree(directory)
                removed.append(directory)
                continue
            for name in names:
                if TMP_MARK in name:
                    self.storage.remove(f"{directory}/{name}")
                    removed.append(f"{directory}/{name}")
        for name in self.storage.list_dir(""):
            if name.startswith(PROBE_PREFIX):
                self.storage.remove(name)
        for name in self.storage.list_dir(DELETED_DIR):
            self._delete(f"{DELETED_DIR}/{name}")  # pruned, but a crash came before their files were gone
            removed.append(f"{DELETED_DIR}/{name}")
        self.storage.abort_uploads(SNAPSHOTS_DIR)
        if removed:
            self.storage.sync_dir(SNAPSHOTS_DIR)
            logger.info("removed uncommitted leftovers under %s: %s", self.url, removed)
        return removed


def _state_hash_of_files(tensors: list[TensorEntry], files: Mapping[str, FileEntry]) -> str:
    """The `state_hash` of a snapshot, from the SHA-256 of its model and optimizer shards."""
    model = dict.fromkeys(e.file for e in tensors if not e.name.startswith(OPTIMIZER_PREFIX))
    optimizer = dict.fromkeys(e.file for e in tensors if e.name.startswith(OPTIMIZER_PREFIX))
    try:
        return combine_file_digests([files[n].sha256 for n in model], [files[n].sha256 for n in optimizer])
    except KeyError as exc:
        raise CorruptSnapshotError(f"the manifest lists tensors in {exc} but no hash for it", str(exc)) from None


def _entries(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, str, list[int], int]]:
    if not isinstance(tensors, Mapping) or not tensors:
        raise ValueError("tensors must be a non-empty mapping of name -> tensor")
    out = []
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"tensor names must be non-empty strings other than '__metadata__', got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{name!r}] is a {type(t).__name__}, not a tensor")
        out.append((name, dtype_name(t, name), list(t.shape), t.numel() * t.element_size()))
    return out


def _allocate(manifest: Manifest, out: Mapping[str, torch.Tensor] | None, url: str) -> dict[str, torch.Tensor]:
    if out is None:
        try:
            return {e.name: torch.empty(e.shape, dtype=BY_NAME[e.dtype]) for e in manifest.tensors}
        except KeyError as exc:
            raise CorruptSnapshotError(f"{url}: the manifest names an unknown dtype {exc}", url) from exc
    if list(out) != [e.name for e in manifest.tensors]:
        raise ValueError(f"out holds other tensors (or another order) than the snapshot {url}")
    for e in manifest.tensors:
        t = out[e.name]
        if (str(t.dtype).removeprefix("torch.") != e.dtype or list(t.shape) != e.shape
                or t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError(f"out[{e.name!r}] must be a contiguous CPU {e.dtype} tensor of shape {e.shape}, "
                             f"got {t.dtype} {list(t.shape)} on {t.device}")
    return dict(out)


def _check_is_root(storage: Storage) -> None:
    names = storage.list_dir("")
    if MANIFEST_FILE in names:
        raise StorageError(f"{storage.url} is a single snapshot directory; open the storage root that holds "
                           f"{SNAPSHOTS_DIR}/ (two levels up)")
    if SNAPSHOTS_DIR not in names:
        raise StorageError(f"{storage.url} is not a zocheck-ray storage root: it holds no {SNAPSHOTS_DIR}/ directory")
