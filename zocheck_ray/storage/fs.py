"""Where durable state lives: storage URLs and the few file operations snapshots and the log need.

    storage = open_storage("s3://bucket/run", {"endpoint_url": "http://127.0.0.1:9000"})
    storage.write_atomic("snapshots/step-000000000010/manifest.json", data)

Local paths, `s3://` and `memory://` (tests) map to one `Storage`. Opening one test-writes it, so a
bad URL or credential fails before training starts. A local file is written, fsync'd and renamed;
an object appears whole or not at all.

A write counts as durable only while `Written`, what the writer knows of it, agrees with `observe`,
what is at its path now; otherwise the storage changed under the writer (`StorageLostError`).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import shutil
import stat as kinds
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, ContextManager, Iterator, Protocol

import fsspec

from zocheck_ray.storage.errors import (
    ObjectNotFoundError, StorageError, StorageFullError, StorageLostError, StorageRefusedError, StorageURLError,
)
from zocheck_ray.host.localfile import open_local_write

SUPPORTED = "a local path, file://PATH, s3://BUCKET[/PREFIX] or memory://PATH"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
_SCHEME_LIKE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(?!//)")
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@")
TMP_MARK = ".tmp-"
"""Part of the name of every temporary file (never committed)."""
PROBE_PREFIX = ".zocheck-probe-"

_NETWORK_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "urllib3")

logger = logging.getLogger(__name__)


def redact(url: str) -> str:
    """The URL without any `user:password@` part, fit for messages and logs."""
    return _USERINFO.sub(r"\1***@", str(url))


_FULL = (errno.ENOSPC, errno.EDQUOT)
"""The errors of a store without space left for a write."""
_REFUSED = (errno.EROFS, errno.EACCES, errno.EPERM)
"""The errors of a store that refuses writes until someone changes it: read-only, denied, immutable."""
_WRITES = frozenset({"write", "append to", "create", "rename", "repair", "sync"})
"""Actions whose target's directory (or bucket) exists: a missing one was removed under the writer."""


@dataclass(frozen=True)
class Written:
    """What a writer knows of a file or directory it made, to confirm later that its path still holds it:
    `identity` is locally `(st_dev, st_ino)`, so a path naming another inode no longer holds what was written;
    on an object store, the ETag seen once the upload completed."""

    rel: str
    size: int | None
    """Bytes written; None for a directory."""
    identity: tuple[int, int] | str | None = None

    def changed(self, now: "Written | None") -> str | None:
        """How `now` (what `observe` finds at `rel`) differs from what was written, or None where it does not."""
        if now is None:
            return "is gone"
        if self.identity is not None and now.identity is not None and now.identity != self.identity:
            if isinstance(self.identity, tuple):
                kind = "file" if self.size is not None else "directory"
                return (f"names another {kind} than the one written (it or a directory above it was deleted or "
                        "replaced, or a file system was mounted over it)")
            return "was replaced by another object (its ETag changed)"
        if self.size is not None and now.size != self.size:
            return f"holds {now.size} bytes, not the {self.size} written"
        return None


def _is_storage_failure(exc: BaseException) -> bool:
    return isinstance(exc, (OSError, TimeoutError)) or type(exc).__module__.split(".")[0] in _NETWORK_MODULES


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


class Storage(Protocol):
    """The operations snapshots and the log use, on paths relative to the store's root."""

    url: str
    local: bool
    """True for a local filesystem, False for an object store."""

    def url_of(self, rel: str) -> str: ...
    def local_path(self, rel: str) -> str: ...
    def open_write(self, rel: str, durable: bool = True,
                   written: list[Written] | None = None) -> ContextManager[BinaryIO]: ...
    def make_durable(self, rels: list[str]) -> None: ...
    def rename(self, rel: str, new_rel: str) -> None: ...
    def write_atomic(self, rel: str, data: bytes) -> Written: ...
    def observe(self, rel: str) -> Written | None: ...
    def observe_dir(self, rel: str) -> dict[str, Written]: ...
    def create_exclusive(self, rel: str, data: bytes) -> bool: ...
    def open_read(self, rel: str) -> ContextManager[BinaryIO]: ...
    def read_bytes(self, rel: str) -> bytes: ...
    def list_dir(self, rel: str) -> list[str]: ...
    def size(self, rel: str) -> int: ...
    def exists(self, rel: str) -> bool: ...
    def remove(self, rel: str) -> None: ...
    def remove_tree(self, rel: str) -> None: ...
    def make_dirs(self, rel: str) -> None: ...
    def sync_dir(self, rel: str) -> None: ...
    def guard(self, action: str, rel: str) -> ContextManager[None]: ...
    def abort_uploads(self, rel: str) -> int: ...


class FsspecStorage:
    """`Storage` over an fsspec filesystem; local files use `os` directly."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str, local: bool):
        self.fs = fs
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.url = redact(url)
        self.local = local

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    # ------------------------------------------------------------------ paths and errors

    def _path(self, rel: str) -> str:
        if not rel:
            return self.root
        return f"{self.root}/{rel}" if self.root not in ("/", "") else f"{self.root}{rel}"

    def url_of(self, rel: str) -> str:
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url

    def local_path(self, rel: str) -> str:
        if not self.local:
            raise StorageError(f"{self.url} is not a local filesystem")
        return self._path(rel)

    def error(self, action: str, rel: str, exc: BaseException) -> StorageError:
        """A `StorageError` naming the object and the cause."""
        target = self.url_of(rel)
        if isinstance(exc, StorageError):
            return exc
        code = exc.errno if isinstance(exc, OSError) else None
        if isinstance(exc, FileNotFoundError) and action in _WRITES:
            where = "its bucket" if not self.local else "its directory"
            return StorageLostError(f"cannot {action} {target}: {where} is gone (deleted or replaced under the "
                                    "run)", target)
        if isinstance(exc, FileNotFoundError):
            return ObjectNotFoundError(f"cannot {action} {target}: it does not exist")
        if code == errno.EROFS:
            return StorageRefusedError(f"cannot {action} {target}: the file system is read-only ({_reason(exc)}); "
                                       "remount it read-write or give the run another storage", code)
        if isinstance(exc, PermissionError) or code in _REFUSED:
            return StorageRefusedError(f"cannot {action} {target}: permission denied ({_reason(exc)}); check the "
                                       "path's permissions and attributes (chattr -i), or the credentials", code)
        if code in _FULL:
            return StorageFullError(f"cannot {action} {target}: {_reason(exc)} ({errno.errorcode[code]}); free "
                                    "space there, or give the run a larger storage", code)
        error = StorageError(f"cannot {action} {target}: {_reason(exc)}"
                             + (f" ({errno.errorcode[code]})" if code in errno.errorcode else ""))
        error.errno = code
        return error

    @contextmanager
    def guard(self, action: str, rel: str) -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except BaseException as exc:
            if _is_storage_failure(exc):
                raise self.error(action, rel, exc) from exc
            raise

    # ------------------------------------------------------------------ writing

    @contextmanager
    def open_write(self, rel: str, durable: bool = True, written: list[Written] | None = None) -> Iterator[BinaryIO]:
        """A file or object to write: whole and durable on a clean exit, discarded on an error (`durable=False`:
        left for `make_durable` to fsync many at once)."""
        path = self._path(rel)
        with self.guard("write", rel):
            f = open_local_write(path) if self.local else self.fs.open(path, "wb")
        try:
            with self.guard("write", rel):
                yield f
                if self.local:
                    f.flush()
                    if durable:
                        os.fsync(f.fileno())
                    stat = os.fstat(f.fileno())  # the inode written, before anything can change the path
                    receipt = Written(rel, stat.st_size, (stat.st_dev, stat.st_ino))
                f.close()  # on an object store this completes the upload
                if not self.local:
                    receipt = self._uploaded(rel, f.tell())
        except BaseException:
            self._discard(f, path)
            raise
        if written is not None:
            written.append(receipt)

    def _uploaded(self, rel: str, size: int) -> Written:
        """The object just uploaded to `rel`, as the store shows it: its size must be what was sent."""
        now = self.observe(rel)
        receipt = Written(rel, size, now.identity if now is not None else None)
        if (problem := receipt.changed(now)) is not None:
            raise StorageLostError(f"{self.url_of(rel)} {problem} right after its upload", self.url_of(rel))
        return receipt

    def _discard(self, f, path: str) -> None:
        # Best effort: the caller's error matters more than a failed cleanup.
        try:
            if self.local:
                f.close()
                os.remove(path)
            elif hasattr(f, "discard"):
                f.discard()  # s3fs: aborts the multipart upload, nothing becomes visible
        except Exception:
            pass

    def make_durable(self, rels: list[str]) -> None:
        """fsync the local files `rels` side by side."""
        if not self.local or not rels:
            return

        def sync(rel: str) -> None:
            with self.guard("sync", rel):
                fd = os.open(self._path(rel), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

        if len(rels) == 1:
            sync(rels[0])
            return
        with ThreadPoolExecutor(min(len(rels), 8), thread_name_prefix="zocheck-fsync") as pool:
            for future in [pool.submit(sync, rel) for rel in rels]:
                future.result()

    def rename(self, rel: str, new_rel: str) -> None:
        """Move a local file or directory."""
        if not self.local:
            raise StorageError(f"{self.url} is an object store: objects cannot be renamed")
        with self.guard("rename", rel):
            os.replace(self._path(rel), self._path(new_rel))

    def write_atomic(self, rel: str, data: bytes) -> Written:
        """Write a small object so that readers see all of it or none of it, durably; returns its `Written`."""
        path = self._path(rel)
        with self.guard("write", rel):
            if not self.local:
                self.fs.pipe_file(path, bytes(data))  # one PUT
                return self._uploaded(rel, len(data))
            with _durable_temp_beside(path, data) as tmp:
                stat = os.stat(tmp)  # the inode the rename puts at `path`
                os.replace(tmp, path)
            _fsync_dir(os.path.dirname(path))
        return Written(rel, len(data), (stat.st_dev, stat.st_ino))

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create `rel` holding `data`, durably, unless it exists (False); of two racers exactly one gets True where
        the store creates atomically."""
        path = self._path(rel)
        with self.guard("write", rel):
            if self.local:
                try:
                    with _durable_temp_beside(path, data) as tmp:
                        os.link(tmp, path)  # atomic: fails when another writer created it first
                except FileExistsError:
                    return False
                _fsync_dir(os.path.dirname(path))
                return True
            try:
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
            except OSError as exc:
                if not _conditional_put_refused(exc):
                    raise
                _warn_no_conditional_put(self.url, exc)
                if self.exists(rel):
                    return False
                self.fs.pipe_file(path, data)
        return True

    # ------------------------------------------------------------------ reading

    @contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryIO]:
        """A file to read; `file_size(f)` gives its size without another request."""
        path = self._path(rel)
        with self.guard("read", rel):
            if self.local:
                f = open(path, "rb")
            else:
                self.fs.invalidate_cache(path)
                # Large sequential reads: each read() is one ranged GET, no read-ahead copy.
                f = self.fs.open(path, "rb", cache_type="none")
            with f:
                yield f

    def read_bytes(self, rel: str) -> bytes:
        with self.guard("read", rel):
            if self.local:
                with open(self._path(rel), "rb") as f:
                    return f.read()
            if hasattr(self.fs, "call_s3"):
                return self.fs.cat_file(self._path(rel), max_concurrency=1)  # one GET, no HEAD first
            return self.fs.cat_file(self._path(rel))

    def list_dir(self, rel: str) -> list[str]:
        """Names of the entries under `rel`; empty when it does not exist."""
        path = self._path(rel)
        with self.guard("list", rel):
            if self.local:
                try:
                    return sorted(os.listdir(path))
                except (FileNotFoundError, NotADirectoryError):
                    return []
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
            return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != path.rstrip("/")})

    def size(self, rel: str) -> int:
        path = self._path(rel)
        with self.guard("stat", rel):
            if self.local:
                return os.stat(path).st_size
            self.fs.invalidate_cache(path)
            return int(self.fs.info(path)["size"])

    def exists(self, rel: str) -> bool:
        path = self._path(rel)
        with self.guard("stat", rel):
            if self.local:
                return os.path.exists(path)
            self.fs.invalidate_cache(path)
            return bool(self.fs.exists(path))

    def observe(self, rel: str) -> Written | None:
        """What is at `rel` now (its size, and locally its inode; None for a directory's size), or None."""
        path = self._path(rel)
        with self.guard("stat", rel):
            if self.local:
                try:
                    return _local_written(rel, os.stat(path))
                except (FileNotFoundError, NotADirectoryError):
                    return None
            self.fs.invalidate_cache(path)
            try:
                return _object_written(rel, self.fs.info(path))
            except FileNotFoundError:
                return None

    def observe_dir(self, rel: str) -> dict[str, Written]:
        """`observe` of every entry under `rel`, by name, in one listing; empty when it does not exist."""
        path = self._path(rel)
        with self.guard("list", rel):
            if self.local:
                out = {}
                try:
                    with os.scandir(path) as entries:
                        for entry in entries:
                            try:
                                out[entry.name] = _local_written(f"{rel}/{entry.name}", entry.stat())
                            except FileNotFoundError:  # removed since the listing
                                pass
                except (FileNotFoundError, NotADirectoryError):
                    return {}
                return out
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=True)
            except FileNotFoundError:
                return {}
            out = {}
            for e in entries:
                name = e["name"].rstrip("/").rsplit("/", 1)[-1]
                if e["name"].rstrip("/") != path.rstrip("/"):
                    out[name] = _object_written(f"{rel}/{name}", e)
            return out

    # ------------------------------------------------------------------ removing, directories

    def remove(self, rel: str) -> None:
        path = self._path(rel)
        with self.guard("delete", rel):
            try:
                os.remove(path) if self.local else self.fs.rm_file(path)
            except FileNotFoundError:
                pass

    def remove_tree(self, rel: str) -> None:
        path = self._path(rel)
        with self.guard("delete", rel):
            if self.local:
                shutil.rmtree(path, ignore_errors=False) if os.path.isdir(path) else None
                return
            self.fs.invalidate_cache(path)
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(path)

    def make_dirs(self, rel: str) -> None:
        if self.local:
            with self.guard("create", rel):
                os.makedirs(self._path(rel), exist_ok=True)
        # Object stores have no directories: a prefix exists once an object is under it.

    def sync_dir(self, rel: str) -> None:
        """Make a directory's entries durable (local disk only)."""
        if self.local:
            with self.guard("sync", rel):
                _fsync_dir(self._path(rel))

    def abort_uploads(self, rel: str) -> int:
        """Abort unfinished multipart uploads under `rel`; returns how many."""
        if self.local or not hasattr(self.fs, "call_s3"):
            return 0
        bucket, _, prefix = self._path(rel).partition("/")
        with self.guard("list uploads under", rel):
            listing = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
            uploads = listing.get("Uploads", [])
            for up in uploads:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        return len(uploads)


def _local_written(rel: str, stat: os.stat_result) -> Written:
    return Written(rel, stat.st_size if kinds.S_ISREG(stat.st_mode) else None, (stat.st_dev, stat.st_ino))


def _object_written(rel: str, info: dict) -> Written:
    if info.get("type") == "directory":
        return Written(rel, None)
    etag = info.get("ETag") or info.get("etag")
    return Written(rel, int(info["size"]), etag.strip('"') if isinstance(etag, str) else None)


_warned_stores: set[str] = set()


def _conditional_put_refused(exc: OSError) -> bool:
    text = str(exc)
    return any(s in text for s in ("NotImplemented", "not implemented", "If-None-Match", "InvalidArgument"))


def _warn_no_conditional_put(url: str, exc: BaseException) -> None:
    if url not in _warned_stores:
        _warned_stores.add(url)
        logger.warning("%s refuses conditional PUTs (If-None-Match): an exclusive create there is a check and a "
                       "PUT, so two writers racing for its lease are told apart by reading it back, and a tie is "
                       "found at the next renewal (%s)", url, exc)


def file_size(f) -> int:
    """Size of a file opened by `open_read`."""
    size = getattr(f, "size", None)
    return int(size) if size is not None else os.fstat(f.fileno()).st_size


@contextmanager
def _durable_temp_beside(path: str, data: bytes) -> Iterator[str]:
    """A temporary file beside `path` holding `data`, fsync'd; removed on exit unless moved into place."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}{TMP_MARK}{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        yield tmp
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- opening


def parse_url(url: str | os.PathLike) -> tuple[str, str]:
    """`(scheme, root path)` of a storage URL; scheme is `file`, `s3` or `memory`."""
    text = os.fspath(url) if isinstance(url, os.PathLike) else url
    if not isinstance(text, str) or not text.strip():
        raise StorageURLError(f"storage URL must be a non-empty string ({SUPPORTED}), got {url!r}")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise StorageURLError(f"storage URL {redact(text)!r} holds a control character; use {SUPPORTED}")
    match = _SCHEME.match(text)
    if match is None:
        if (near := _SCHEME_LIKE.match(text)) is not None:
            # "s3:/bucket" or "s3:bucket" would otherwise become a local directory named "s3:".
            raise StorageURLError(f"{redact(text)} looks like a {near.group(1)!r} URL without its '//'; write "
                                  f"{near.group(1)}://..., or ./{text} for a local path ({SUPPORTED})")
        return "file", os.path.abspath(os.path.expanduser(text))
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == "file":
        if not rest.startswith("/"):
            raise StorageURLError(f"{redact(text)}: a file:// URL needs an absolute path (file:///data/run)")
        return "file", os.path.abspath(rest)
    if scheme == "s3":
        bucket = rest.split("/", 1)[0]
        if not bucket:
            raise StorageURLError(f"{redact(text)} names no bucket: an S3 URL is s3://BUCKET[/PREFIX], "
                                  "e.g. s3://my-bucket/zocheck-runs")
        if "@" in bucket:
            raise StorageURLError(f"{redact(text)}: an S3 URL is s3://BUCKET[/PREFIX] "
                                  "(credentials go in storage_options or the AWS environment, not the URL)")
        if not _BUCKET.match(bucket):
            raise StorageURLError(f"{redact(text)}: {bucket!r} is not an S3 bucket name (letters, digits, '.', "
                                  "'-'); an S3 URL is s3://BUCKET[/PREFIX]")
        prefix = rest[len(bucket):].strip("/")
        if any(part in (".", "..") for part in prefix.split("/")):
            raise StorageURLError(f"{redact(text)}: '.' and '..' are not directories on S3; write the prefix "
                                  "without them")
        return "s3", f"{bucket}/{prefix}" if prefix else bucket
    if scheme == "memory":
        return "memory", "/" + rest.strip("/")
    hint = " (s3a:// and s3n:// are Hadoop's names: write s3://)" if scheme in ("s3a", "s3n") else ""
    raise StorageURLError(f"unsupported storage URL scheme {scheme!r} in {redact(text)}: use {SUPPORTED}{hint}")


def open_storage(url: str | os.PathLike, storage_options: dict | None = None, *, create: bool = True) -> FsspecStorage:
    """Open (and with `create`, make and test-write) the store at `url`."""
    scheme, root = parse_url(url)
    shown = redact(os.fspath(url))
    options = dict(storage_options or {})
    if scheme == "file":
        if options:
            raise StorageURLError(f"{shown} is a local path; storage_options {sorted(options)} do not apply")
        storage = FsspecStorage(fsspec.filesystem("file"), root, shown, local=True)
        _check_local(storage, root, create)
    elif scheme == "s3":
        try:
            import s3fs
        except ImportError as exc:  # pragma: no cover - s3fs is a dependency
            raise StorageError(f"{shown} needs s3fs: pip install s3fs") from exc
        # Separate instances so a cached listing of another instance never hides an object.
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **_with_shared_descriptions(s3fs, options))
        storage = FsspecStorage(fs, root, shown, local=False)
        _check_bucket(storage, root.split("/")[0])
    else:
        storage = FsspecStorage(fsspec.filesystem("memory", **options), root, shown, local=False)
    if create:
        _probe_write(storage)
    elif storage.local and not storage.exists(""):
        raise ObjectNotFoundError(f"{shown} does not exist")  # an object store has no empty directories to check
    return storage


_DESCRIPTIONS: dict[str | None, object] = {}
"""botocore's loaders of its service descriptions, one per data path (`AWS_DATA_PATH`) and process."""


def _with_shared_descriptions(s3fs, options: dict) -> dict:
    """`options` with a botocore session whose service descriptions come from one loader per process, since
    parsing them per store is slow."""
    from aiobotocore.session import AioSession

    if "session" in options or not set(options) <= _filesystem_parameters(s3fs.S3FileSystem):
        return options
    session = AioSession()
    data_path = session.get_config_variable("data_path")  # AWS_DATA_PATH, or the AWS config file's
    session.register_component("data_loader", _DESCRIPTIONS.setdefault(data_path, session.get_component("data_loader")))
    return {**options, "session": session}


@functools.cache
def _filesystem_parameters(cls) -> frozenset[str]:
    """The keyword arguments `cls` takes itself."""
    import inspect

    return frozenset(inspect.signature(cls.__init__).parameters)


def _check_local(storage: FsspecStorage, root: str, create: bool) -> None:
    if os.path.exists(root) and not os.path.isdir(root):
        raise StorageError(f"{storage.url} is a file, not a directory")
    if create:
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create {storage.url}: {_reason(exc)}") from exc


def _check_bucket(storage: FsspecStorage, bucket: str) -> None:
    try:
        storage.fs.call_s3("head_bucket", Bucket=bucket)
    except FileNotFoundError as exc:
        raise StorageError(f"bucket {bucket!r} of {storage.url} does not exist; create it first") from exc
    except PermissionError as exc:
        raise StorageError(f"access to bucket {bucket!r} of {storage.url} is denied: check the "
                           "credentials (storage_options key/secret or the AWS environment)") from exc
    except BaseException as exc:
        if _is_storage_failure(exc):
            raise StorageError(f"cannot reach {storage.url}: {_reason(exc)} (check endpoint_url and the network)") from exc
        raise


def _probe_write(storage: FsspecStorage) -> None:
    """Write and remove a tiny object so a read-only path or credential fails now, not mid-run."""
    probe_write(storage, "")


def probe_write(storage: FsspecStorage, directory: str) -> None:
    """Write and remove a tiny object in `directory` (relative; "" for the root); raises the `StorageError` that
    says why it was not taken."""
    name = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    rel = f"{directory.rstrip('/')}/{name}" if directory else name
    where = storage.url_of(directory)
    try:
        if storage.local:
            with open(storage.local_path(rel), "wb") as f:
                f.write(b"ok")
            os.remove(storage.local_path(rel))
        else:
            storage.fs.pipe_file(storage._path(rel), b"ok")
            storage.fs.rm_file(storage._path(rel))
    except BaseException as exc:
        if not _is_storage_failure(exc):
            raise
        code = getattr(exc, "errno", None)
        if code in _FULL:  # full, not broken: the caller waits or says so
            raise StorageFullError(f"{where} is not writable: {_reason(exc)} ({errno.errorcode[code]}); free "
                                   "space there, or give the run a larger storage", code) from exc
        if isinstance(exc, PermissionError) or code in _REFUSED:
            raise StorageRefusedError(f"{where} is not writable: {_reason(exc)}"
                                      + (f" ({errno.errorcode[code]})" if code in errno.errorcode else "")
                                      + "; check its permissions and attributes (chattr -i), or the credentials",
                                      code) from exc
        raise StorageError(f"{where} is not writable: {_reason(exc)}") from exc
