"""Local snapshot files: direct I/O through aligned staging buffers, with a buffered fallback.

Every size around the alignment and the staging buffer must come back byte for byte,
with the file's true size (the padded tail is truncated away) and fsync'd by `open_write`.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

from zocheck_ray.storage import SnapshotStore
from zocheck_ray.host import localfile as storage_fs
from zocheck_ray.storage.fs import open_storage
from zocheck_ray.host.localfile import DIRECT_ALIGN, DIRECT_BUFFER_BYTES

SIZES = [0, 1, DIRECT_ALIGN - 1, DIRECT_ALIGN, DIRECT_ALIGN + 1, DIRECT_BUFFER_BYTES - 1, DIRECT_BUFFER_BYTES,
         2 * DIRECT_BUFFER_BYTES + 12345]


def _direct_io_works(directory) -> bool:
    path = os.path.join(directory, "probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        return False
    os.close(fd)
    os.remove(path)
    return hasattr(os, "O_DIRECT")


@pytest.mark.parametrize("size", SIZES)
def test_open_write_returns_every_byte_at_its_true_size(tmp_path, size):
    storage = open_storage(str(tmp_path / "store"), create=True)
    data = os.urandom(size)
    with storage.open_write("blob") as f:
        expected_kind = storage_fs._DirectFile if _direct_io_works(tmp_path) else storage_fs._WritebackFile
        assert type(f) is expected_kind
        step = 1_000_003  # odd pieces: buffer boundaries fall inside writes
        for a in range(0, size, step):
            assert f.write(data[a : a + step]) == len(data[a : a + step])
        assert f.tell() == size
    path = tmp_path / "store" / "blob"
    assert path.stat().st_size == size
    assert path.read_bytes() == data


def test_buffered_fallback_writes_the_same_bytes(tmp_path, monkeypatch):
    from zocheck_ray.host.capabilities import capabilities

    monkeypatch.delattr(storage_fs.os, "O_DIRECT", raising=False)  # a platform without direct I/O
    capabilities.cache_clear()  # probed again without it
    try:
        storage = open_storage(str(tmp_path / "store"), create=True)
        data = os.urandom(DIRECT_BUFFER_BYTES + 77)
        with storage.open_write("blob") as f:
            assert type(f) is storage_fs._WritebackFile
            f.write(data)
        assert (tmp_path / "store" / "blob").read_bytes() == data
    finally:
        monkeypatch.undo()
        capabilities.cache_clear()


def test_a_direct_file_ends_at_its_flush(tmp_path):
    path = tmp_path / "blob"
    direct = getattr(os, "O_DIRECT", 0) if _direct_io_works(tmp_path) else 0  # the class works on any fd
    f = storage_fs._DirectFile(os.open(path, os.O_WRONLY | os.O_CREAT | direct, 0o644))
    f.write(b"abc")
    f.flush()
    assert path.read_bytes() == b"abc"  # the padded tail is truncated at the flush, before any fsync
    with pytest.raises(ValueError, match="after its flush"):
        f.write(b"more")
    f.close()
    assert f.closed and path.read_bytes() == b"abc"


def _count_fresh_sets(monkeypatch) -> list[bool]:
    """Each staging set a file takes: True where it was fresh memory, False where an idle set was reused."""
    fresh: list[bool] = []
    take = storage_fs._take_staging_buffers

    def counted():
        fresh.append(not storage_fs._free_staging)
        return take()

    monkeypatch.setattr(storage_fs, "_take_staging_buffers", counted)
    return fresh


def _write_direct(path, tmp_path) -> None:
    direct = getattr(os, "O_DIRECT", 0) if _direct_io_works(tmp_path) else 0  # the class works on any fd
    f = storage_fs._DirectFile(os.open(path, os.O_WRONLY | os.O_CREAT | direct, 0o644))
    f.write(b"x" * (DIRECT_BUFFER_BYTES + 5000))
    f.close()


def test_staging_buffers_pass_between_the_files_of_a_scope_and_go_at_its_end(tmp_path, monkeypatch):
    fresh = _count_fresh_sets(monkeypatch)
    for name in ("a", "b"):  # outside a scope a file's buffers go with it: nothing stays resident
        _write_direct(tmp_path / name, tmp_path)
        assert storage_fs._free_staging == []
    assert fresh == [True, True]
    with storage_fs.staging_reuse():
        for name in ("c", "d", "e"):
            _write_direct(tmp_path / name, tmp_path)
            assert len(storage_fs._free_staging) == 1  # kept for the scope's next file
    assert fresh[2:] == [True, False, False] and storage_fs._free_staging == []


def test_a_saved_snapshot_leaves_no_staging_memory_behind(tmp_path, monkeypatch):
    fresh = _count_fresh_sets(monkeypatch)
    store = SnapshotStore(str(tmp_path / "run"))
    store.save(0, {"model.w": torch.ones(1 << 20), "optimizer.exp_avg.model.w": torch.ones(1 << 20)})
    assert storage_fs._free_staging == []
    if _direct_io_works(tmp_path):  # a model file and an optimizer file, through one set of buffers
        assert len(fresh) >= 2 and fresh.count(True) == 1
