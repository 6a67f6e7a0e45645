"""Snapshots (DESIGN.md sections 7, 8): exact round trips, commit marker, corruption, retention, bad input.

Against a temporary directory and a real S3 endpoint on 127.0.0.1 (moto), through s3fs.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import socket

import pytest
import safetensors.torch
import torch

from zocheck_ray.core import EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, StepRecord, ZOConfig, state_hash
from zocheck_ray.core import hashing
from zocheck_ray.core.hashing import combine_file_digests
from zocheck_ray.storage import (
    Lease,
    CorruptSnapshotError,
    SnapshotNotFoundError,
    SnapshotStore,
    StepLog,
    StorageError,
    StorageFullError,
    StorageURLError,
    read_lease,
    recover,
)
from zocheck_ray.storage.manifest import Manifest
from zocheck_ray.storage.snapshot import DELETED_DIR, OPTIMIZER_PREFIX, snapshot_dir

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_state(step: int = 0, dtype: torch.dtype = torch.float32, adam: bool = True) -> dict[str, torch.Tensor]:
    """A canonical state (parameters, then float32 moments), different for every step."""
    gen = torch.Generator().manual_seed(1000 + step)
    params = {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=gen).to(dtype),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=gen).to(dtype),
        "model.layers.0.input_layernorm.weight": torch.randn(16, generator=gen).to(dtype),
        "model.layers.0.mlp.conv": torch.randn(2, 3, 4, generator=gen).to(dtype),
    }
    state = dict(params)
    if adam:
        for prefix in (EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX):
            for name, t in params.items():
                state[prefix + name] = torch.rand(t.shape, generator=gen, dtype=torch.float32)
    return state


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name
    assert state_hash(got) == state_hash(want)


def local_file(tmp_path, step: int, name: str) -> str:
    return os.path.join(tmp_path, "run", snapshot_dir(step), name)


# ---------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_is_exact(root, dtype):
    url, options = root
    state = make_state(3, dtype)
    store = SnapshotStore(url, options)
    info = store.save(3, state, {"run_id": "run-1", "zo_config": ZOConfig(optimizer="zo-adam")})
    assert info.step == 3 and info.state_hash == state_hash(state)

    reopened = SnapshotStore(url, options, create=False)
    latest = reopened.latest()
    assert latest is not None and latest.step == 3
    tensors, meta = reopened.load(latest)
    assert_same_state(tensors, state)
    assert meta.run_id == "run-1"
    assert ZOConfig.model_validate(meta.zo_config) == ZOConfig(optimizer="zo-adam")
    assert [e.name for e in latest.manifest.tensors] == list(state)


@pytest.mark.parametrize("url", ["file", "memory"])
def test_file_and_memory_urls_round_trip(tmp_path, url):
    url = f"file://{tmp_path}/run" if url == "file" else f"memory://zocheck-test-{os.getpid()}-{id(tmp_path)}/run"
    state = make_state(1, torch.bfloat16)
    store = SnapshotStore(url)
    store.save(1, state)
    tensors, _ = SnapshotStore(url, create=False).load(1)
    assert_same_state(tensors, state)


def test_files_are_standard_safetensors_split_model_and_optimizer(tmp_path):
    state = make_state(0, torch.bfloat16)
    SnapshotStore(str(tmp_path / "run")).save(0, state)
    model = safetensors.torch.load_file(local_file(tmp_path, 0, "model.safetensors"))
    optim = safetensors.torch.load_file(local_file(tmp_path, 0, "optimizer.safetensors"))
    assert set(model) == {n for n in state if not n.startswith(OPTIMIZER_PREFIX)}
    assert set(optim) == {n for n in state if n.startswith(OPTIMIZER_PREFIX)}
    for name, t in {**model, **optim}.items():
        assert torch.equal(t, state[name])


def test_hugging_face_loads_a_snapshot_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    from zocheck_ray.workload import build_model, trainable_parameters

    model = build_model("tiny-llama", seed=3)
    state = {n: p.detach() for n, p in trainable_parameters(model)}
    info = SnapshotStore(str(tmp_path / "run")).save(7, state, {"hf_config": model.config})
    loaded = AutoModelForCausalLM.from_pretrained(info.url)
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), state[name]), name
    _, meta = SnapshotStore(str(tmp_path / "run"), create=False).load(7)
    assert meta.hf_config["model_type"] == "llama"


def test_load_fills_preallocated_tensors_in_place(tmp_path):
    state = make_state(2)
    store = SnapshotStore(str(tmp_path / "run"))
    store.save(2, state)
    out = {n: torch.empty_like(t) for n, t in state.items()}
    pointers = {n: t.data_ptr() for n, t in out.items()}
    tensors, _ = store.load(2, out=out)
    assert_same_state(tensors, state)
    assert {n: t.data_ptr() for n, t in tensors.items()} == pointers
    with pytest.raises(ValueError, match="must be a contiguous CPU float32"):
        store.load(2, out={**out, "model.embed_tokens.weight": torch.empty(64, 16, dtype=torch.float16)})


def test_the_state_hash_follows_from_the_file_digests_and_is_checked_on_load(root):
    url, options = root
    store = SnapshotStore(url, options)
    for step, state in ((4, make_state(4, torch.bfloat16)), (7, make_state(7, adam=False))):
        digest = state_hash(state)
        info = store.save(step, state, state_hash=digest)
        assert info.state_hash == digest  # the save hashed each file once; the state hash is derived
        files = {name: hashlib.sha256(store.storage.read_bytes(f"{snapshot_dir(step)}/{name}")).hexdigest()
                 for name in ("model.safetensors", "optimizer.safetensors") if name in info.manifest.files}
        assert list(files) == (["model.safetensors", "optimizer.safetensors"] if step == 4 else ["model.safetensors"])
        optimizer_digests = [files["optimizer.safetensors"]] if "optimizer.safetensors" in files else []
        assert combine_file_digests([files["model.safetensors"]], optimizer_digests) == digest
        tensors, _ = SnapshotStore(url, options, create=False).load(step)
        assert_same_state(tensors, state)

    state = make_state(5)
    with pytest.raises(ValueError, match=r"state_hash 000000000000\.\.\. was given for step 5"):
        store.save(5, state, state_hash="0" * 64)  # not this state's hash: nothing is committed
    assert [i.step for i in store.committed()] == [7, 4] and store.storage.list_dir(snapshot_dir(5)) == []
    with pytest.raises(ValueError, match="state_hash must be the 64 lowercase hex digits"):
        store.save(6, state, state_hash=state_hash(state).upper())

    # a manifest that is whole (its own checksum holds) but names another state hash
    rel = f"{snapshot_dir(4)}/manifest.json"
    manifest = Manifest.decode(store.storage.read_bytes(rel), rel)
    store.storage.write_atomic(rel, manifest.model_copy(update={"state_hash": "0" * 64}).encode())
    with pytest.raises(CorruptSnapshotError, match=r"do not hash to the state_hash in .*step-000000000004/manifest"):
        store.load(4)


def test_a_large_state_is_sharded_hugging_face_style_and_loads_back(root, monkeypatch, tmp_path):
    url, options = root
    monkeypatch.setattr(hashing, "SHARD_BYTES", 4096)  # the embedding (4 KiB) alone fills a shard
    state = make_state(3)
    digest = state_hash(state)
    store = SnapshotStore(url, options)
    info = store.save(3, state, {"hf_config": {"model_type": "llama"}})
    assert info.state_hash == digest
    names = [e.file for e in info.manifest.tensors]
    model_files = list(dict.fromkeys(n for n in names if n.startswith("model")))
    assert model_files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert list(dict.fromkeys(n for n in names if n.startswith("optimizer"))) == [
        "optimizer-00001-of-00004.safetensors", "optimizer-00002-of-00004.safetensors",
        "optimizer-00003-of-00004.safetensors", "optimizer-00004-of-00004.safetensors"]
    index = json.loads(store.storage.read_bytes(f"{snapshot_dir(3)}/model.safetensors.index.json"))
    assert index["weight_map"] == {n: e.file for n, e in zip(state, info.manifest.tensors) if e.file in model_files}
    assert index["metadata"]["total_size"] == sum(e.nbytes for e in info.manifest.tensors if e.file in model_files)
    shard_digests = {n: hashlib.sha256(store.storage.read_bytes(f"{snapshot_dir(3)}/{n}")).hexdigest()
                     for n in dict.fromkeys(names)}
    assert combine_file_digests([shard_digests[n] for n in model_files],
                                [d for n, d in shard_digests.items() if n.startswith("optimizer")]) == digest
    tensors, meta = SnapshotStore(url, options, create=False).load(3)
    assert_same_state(tensors, state) and meta.hf_config == {"model_type": "llama"}

    # every shard is checked: a damaged second shard is named, and the snapshot is not loaded
    rel = f"{snapshot_dir(3)}/model-00002-of-00002.safetensors"
    data = bytearray(store.storage.read_bytes(rel))
    data[-1] ^= 0x01
    store.storage.write_atomic(rel, bytes(data))
    with pytest.raises(CorruptSnapshotError, match="model-00002-of-00002.safetensors fails its SHA-256"):
        store.load(3)


def test_latest_is_the_newest_commit_and_a_step_is_saved_once(root):
    url, options = root
    store = SnapshotStore(url, options, keep=3)
    assert store.latest() is None
    for step in (1, 5, 3):
        store.save(step, make_state(step))
    assert store.latest().step == 5
    assert [i.step for i in store.committed()] == [5, 3, 1]
    again = store.save(5, make_state(5))
    assert again.manifest.created_unix == store.get(5).manifest.created_unix
    with pytest.raises(StorageError, match="already committed with another state"):
        store.save(5, make_state(6))
    with pytest.raises(SnapshotNotFoundError, match="step 4"):
        store.load(4)


# ---------------------------------------------------------------------- commit marker and cleanup


def test_a_directory_without_manifest_is_never_loaded_and_is_cleaned_at_start(tmp_path):
    url = str(tmp_path / "run")
    store = SnapshotStore(url)
    store.save(1, make_state(1))
    store.save(2, make_state(2))
    os.remove(local_file(tmp_path, 2, "manifest.json"))  # as if the writer died before its commit
    with open(os.path.join(tmp_path, "run", snapshot_dir(1), ".manifest.json.tmp-dead"), "wb") as f:
        f.write(b"{")
    assert SnapshotStore(url, create=False).latest().step == 1
    SnapshotStore(url)  # without the run's lease, nothing is removed: it may be a live writer's save
    assert len(os.listdir(tmp_path / "run" / "snapshots")) == 2
    SnapshotStore(url, lease=Lease(url).acquire())  # a restarted writer, under the lease
    assert sorted(os.listdir(tmp_path / "run" / "snapshots")) == [os.path.basename(snapshot_dir(1))]
    assert ".manifest.json.tmp-dead" not in os.listdir(tmp_path / "run" / snapshot_dir(1))


def test_a_snapshot_that_does_not_fit_is_removed_at_once_and_the_log_and_the_lease_go_on(small_disk):
    url = str(small_disk.path / "run")
    lease = Lease(url, owner="writer").acquire()
    store, log = SnapshotStore(url, lease=lease), StepLog(url, lease=lease)
    weight = torch.arange(128 * 1024, dtype=torch.float32)  # 512 KiB, and twice that of ZO-Adam moments
    state = {"weight": weight, EXP_AVG_PREFIX + "weight": weight, EXP_AVG_SQ_PREFIX + "weight": weight}
    store.save(0, state)
    page = os.statvfs(small_disk.path).f_frsize
    model_bytes = -(-os.path.getsize(local_file(small_disk.path, 0, "model.safetensors")) // page) * page
    small_disk.fill(leave=model_bytes + page)  # the model's file fits, its optimizer's does not
    with pytest.raises(StorageFullError) as full:
        store.save(1, state)
    # the storage's own error, naming the file that did not fit
    assert full.value.errno == errno.ENOSPC
    assert re.fullmatch(rf"cannot \w+ {re.escape(url)}/{snapshot_dir(1)}/optimizer\.safetensors: No space left on "
                        r"device \(ENOSPC\); free space there, or give the run a larger storage", str(full.value))
    # nothing of it is left to hold the space that the log and the lease's renewals need
    assert os.listdir(small_disk.path / "run" / "snapshots") == [os.path.basename(snapshot_dir(0))]
    assert small_disk.free_bytes() == model_bytes + page
    for step in range(64):
        log.append(StepRecord(step=step, seed=step + 1, projected_grad=0.5, lr=1e-3, eps=1e-3, fingerprint=7))
        log.flush()
    assert log.durable_step == 63
    lease.renew()
    assert lease.held and read_lease(lease.storage).generation == lease.generation
    small_disk.free()
    assert store.save(1, state).step == 1


def test_s3_leftovers_and_unfinished_uploads_are_cleaned_at_start(s3_bucket):
    import s3fs

    url, options = s3_bucket
    SnapshotStore(url, options).save(1, make_state(1))
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    dead = f"{bucket}/{prefix}/{snapshot_dir(2)}"
    fs.pipe_file(f"{dead}/model.safetensors", b"partial")
    fs.call_s3("create_multipart_upload", Bucket=bucket, Key=f"{prefix}/{snapshot_dir(2)}/optimizer.safetensors")
    assert SnapshotStore(url, options, create=False).latest().step == 1
    SnapshotStore(url, options, lease=Lease(url, options).acquire())
    fs.invalidate_cache()
    assert not fs.exists(f"{dead}/model.safetensors")
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
    assert uploads == []


# ---------------------------------------------------------------------- corruption


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _damage(path: str, how: str) -> None:
    size = os.path.getsize(path)
    if how == "header":
        flip_byte(path, 12)
    elif how == "data":
        flip_byte(path, size - 7)
    elif how == "middle":
        flip_byte(path, size // 2)
    elif how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(size - 3)
    elif how == "missing":
        os.remove(path)


CASES = [
    ("model.safetensors", "header"), ("model.safetensors", "data"), ("model.safetensors", "truncated"),
    ("model.safetensors", "missing"), ("optimizer.safetensors", "data"), ("optimizer.safetensors", "header"),
    ("config.json", "middle"), ("manifest.json", "middle"), ("manifest.json", "truncated"),
]


@pytest.mark.parametrize("name,how", CASES, ids=[f"{n}-{h}" for n, h in CASES])
def test_damage_to_any_file_is_detected_named_and_the_previous_snapshot_used(tmp_path, caplog, name, how):
    url = str(tmp_path / "run")
    config = ZOConfig(optimizer="zo-adam")
    store = SnapshotStore(url)
    meta = {"zo_config": config, "hf_config": {"model_type": "llama", "hidden_size": 16}}
    store.save(1, make_state(1), meta)
    store.save(2, make_state(2), meta)
    _damage(local_file(tmp_path, 2, name), how)

    reader = SnapshotStore(url, create=False)
    with pytest.raises(CorruptSnapshotError) as err:
        reader.load(2)
    assert err.value.url.endswith(f"{snapshot_dir(2)}/{name}")
    assert name in str(err.value)

    with caplog.at_level(logging.WARNING, logger="zocheck_ray.storage"):
        result = recover(url, config=config)
    assert result.snapshot.step == 1 and result.step == 1
    assert_same_state(result.state, make_state(1))
    assert any(name in p for p in result.problems) or any(name in r.getMessage() for r in caplog.records)


def test_damage_on_s3_is_detected_and_named(s3_bucket):
    import s3fs

    url, options = s3_bucket
    store = SnapshotStore(url, options)
    store.save(1, make_state(1))
    store.save(2, make_state(2))
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    path = f"{url.removeprefix('s3://')}/{snapshot_dir(2)}/optimizer.safetensors"
    data = bytearray(fs.cat_file(path))
    data[-1] ^= 0x80
    fs.pipe_file(path, bytes(data))
    with pytest.raises(CorruptSnapshotError, match="optimizer.safetensors"):
        SnapshotStore(url, options, create=False).load(2)


# ---------------------------------------------------------------------- retention


@pytest.mark.parametrize("keep", [2, 3])
def test_retention_keeps_the_newest_k(root, keep):
    url, options = root
    store = SnapshotStore(url, options, keep=keep)
    for step in range(6):
        store.save(step * 10, make_state(step, adam=False))
    assert [i.step for i in store.committed()] == [50, 40, 30, 20][:keep]
    assert len(store.storage.list_dir("snapshots")) == keep


def test_retention_keeps_pinned_and_undecided_held_snapshots_beside_the_newest_k(root):
    """A held snapshot stays until `released_through` reaches it, a pinned one for good, also in a reopened store;
    a damaged retention.json releases nothing."""
    from zocheck_ray.storage.retention import RETENTION_FILE, Retention

    url, options = root
    store = SnapshotStore(url, options, keep=2)
    for step in range(1, 7):
        store.save(step, make_state(step, adam=False), hold=step in (2, 4))
    assert [i.step for i in store.committed()] == [6, 5, 4, 2]
    assert store.set_retention(Retention(pins={"best_dev": 2}, released_through=4)) == [4]
    store.save(7, make_state(7, adam=False))
    assert [i.step for i in SnapshotStore(url, options, create=False).committed()] == [7, 6, 2]
    assert store.retention().pins == {"best_dev": 2} and store.get(2).manifest.held
    store.save(8, make_state(8, adam=False), hold=True)
    store.storage.write_atomic(RETENTION_FILE, b"{}")  # damaged: every held snapshot is kept, none pinned
    store.save(9, make_state(9, adam=False))
    store.save(10, make_state(10, adam=False))
    assert [i.step for i in store.committed()] == [10, 9, 8, 2]
    store.close()


class CheckEveryDeletion:
    """Passes storage calls through; after every deletion or move, a fresh reader must load a snapshot.

    Files of pruned snapshots are deleted on a background thread, so failures are collected, not raised.
    """

    def __init__(self, inner, url, options):
        self._inner, self._url, self._options = inner, url, options
        self.checks = 0
        self.failures: list[str] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _check(self, what):
        reader = SnapshotStore(self._url, self._options, create=False)
        info = reader.latest()
        if info is None:
            self.failures.append(f"no committed snapshot left after {what}")
            return
        tensors, _ = reader.load(info)
        if state_hash(tensors) != info.state_hash:
            self.failures.append(f"the latest snapshot does not load exactly after {what}")
        self.checks += 1

    def remove(self, rel):
        self._inner.remove(rel)
        self._check(f"remove {rel}")

    def remove_tree(self, rel):
        self._inner.remove_tree(rel)
        self._check(f"remove_tree {rel}")

    def rename(self, rel, new_rel):
        self._inner.rename(rel, new_rel)
        self._check(f"rename {rel}")


def test_retention_never_leaves_no_loadable_snapshot(root):
    url, options = root
    with SnapshotStore(url, options, keep=2) as store:
        store.storage = spy = CheckEveryDeletion(store.storage, url, options)
        for step in range(1, 6):
            store.save(step, make_state(step, adam=False))
    assert spy.failures == []
    assert spy.checks >= 6  # every pruned snapshot: manifest first, then the rest


def test_pruned_files_are_deleted_in_the_background_and_after_a_crash_at_the_next_open(tmp_path):
    root = tmp_path / "run"
    store = SnapshotStore(str(root), keep=2)
    for step in range(4):
        store.save(step, make_state(step, adam=False))
    assert sorted(os.listdir(root / "snapshots")) == [os.path.basename(snapshot_dir(s)) for s in (2, 3)]
    store.close()
    assert os.listdir(root / DELETED_DIR) == []  # both pruned snapshots are gone from the disk

    # A crash after a pruned snapshot was moved aside but before its files were deleted:
    (root / DELETED_DIR / "step-000000000001-0badf00d").mkdir()
    (root / DELETED_DIR / "step-000000000001-0badf00d" / "model.safetensors").write_bytes(b"x" * 1000)
    assert [i.step for i in SnapshotStore(str(root), create=False).committed()] == [3, 2]
    SnapshotStore(str(root), lease=Lease(str(root)).acquire())
    assert os.listdir(root / DELETED_DIR) == []


# ---------------------------------------------------------------------- bad input


def test_unknown_scheme_is_rejected_naming_the_url():
    with pytest.raises(StorageURLError, match=r"'gs'.*gs://bucket/run"):
        SnapshotStore("gs://bucket/run")
    with pytest.raises(StorageURLError, match="absolute path"):
        SnapshotStore("file://relative/path")


def test_credentials_in_an_s3_url_are_refused_and_redacted():
    with pytest.raises(StorageURLError) as err:
        SnapshotStore("s3://AKIDEXAMPLE:s3cr3t@bucket/run")
    assert "s3cr3t" not in str(err.value)


def test_unwritable_or_non_directory_paths_fail_at_open(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match=str(blocker)):
        SnapshotStore(str(blocker / "run"))
    with pytest.raises(StorageError, match="is a file, not a directory"):
        SnapshotStore(str(blocker))


def test_read_only_open_needs_an_existing_storage_root(tmp_path):
    with pytest.raises(StorageError, match="does not exist"):
        SnapshotStore(str(tmp_path / "missing"), create=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    with pytest.raises(StorageError, match="not a zocheck-ray storage root"):
        SnapshotStore(str(tmp_path / "other"), create=False)
    info = SnapshotStore(str(tmp_path / "run")).save(1, make_state(1))
    with pytest.raises(StorageError, match="single snapshot directory"):
        SnapshotStore(info.url, create=False)


def test_missing_bucket_fails_at_open(s3_endpoint):
    with pytest.raises(StorageError, match=r"bucket 'zocheck-no-such-bucket' of s3://zocheck-no-such-bucket/run"):
        SnapshotStore("s3://zocheck-no-such-bucket/run", s3_endpoint.options())


def test_s3_stores_of_one_process_parse_the_service_descriptions_once(s3_endpoint):
    """Each store has a session of its own (its credentials, its configuration); botocore's parsed descriptions
    of S3 and its endpoints are the process's one copy. A session s3fs is told to make (`profile`) is left to it."""
    import s3fs

    from zocheck_ray.storage.fs import _with_shared_descriptions, open_storage

    bucket = s3_endpoint.new_bucket()
    first, second = (open_storage(f"s3://{bucket}/run", s3_endpoint.options()) for _ in range(2))
    assert first.fs.session is not second.fs.session
    loader = first.fs.session.get_component("data_loader")
    assert loader is second.fs.session.get_component("data_loader")
    assert any(key[0] == "load_service_model" for key in loader._cache)  # S3's API, parsed by the first store
    for options in ({"profile": "analytics"}, {"session": object()}):
        assert _with_shared_descriptions(s3fs, options) == options


def test_wrong_credentials_fail_at_open_without_showing_them(s3_endpoint, monkeypatch):
    from moto import settings

    bucket = s3_endpoint.new_bucket()
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the endpoint now checks credentials
    options = s3_endpoint.options(key="AKIAWRONGKEY", secret="s3cr3t-value")
    with pytest.raises(StorageError, match="denied") as err:
        SnapshotStore(f"s3://{bucket}/run", options)
    assert "s3cr3t-value" not in str(err.value) and f"s3://{bucket}/run" in str(err.value)


def test_unreachable_endpoint_fails_at_open(aws_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s",
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    with pytest.raises(StorageError, match=r"cannot reach s3://bucket/run"):
        SnapshotStore("s3://bucket/run", options)


def test_invalid_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="keep must be an integer >= 2"):
        SnapshotStore(str(tmp_path / "run"), keep=1)
    store = SnapshotStore(str(tmp_path / "run"))
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        store.save(-1, make_state())
    with pytest.raises(TypeError, match=r"tensors\['x'\] is a list"):
        store.save(1, {"x": [1.0]})
    with pytest.raises(TypeError, match="complex64"):
        store.save(1, {"x": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="non-empty mapping"):
        store.save(1, {})
    assert store.latest() is None


# ---------------------------------------------------------------------- memory and errors across processes

MEMORY_PROBE = """
import resource, sys, torch
from zocheck_ray.storage import SnapshotStore

state = {f"layer.{i}.weight": torch.randn(1 << 22) for i in range(16)}  # 256 MB
store = SnapshotStore(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
store.save(1, state)
after_save = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {n: torch.zeros_like(t) for n, t in state.items()}  # the preallocated replica, touched
before_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
store.load(1, out=out)
after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(before, after_save, before_load, after_load)
"""


def test_save_and_load_stream_without_a_copy_of_the_state(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(MEMORY_PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                          env=env, check=True)
    before, after_save, before_load, after_load = (int(v) for v in done.stdout.split())  # peak RSS, KiB
    state_kib = 256 << 10
    assert after_save - before < state_kib // 4, "a save held a serialized copy of the state"
    assert after_load - before_load < state_kib // 4, "a load into preallocated tensors allocated a copy"


def test_errors_keep_what_they_name_across_processes():
    import pickle

    from zocheck_ray.storage import CorruptLogError

    err = pickle.loads(pickle.dumps(CorruptSnapshotError("bad hash", "s3://b/run/snapshots/x/model.safetensors")))
    assert err.url.endswith("model.safetensors") and str(err) == "bad hash"
    from zocheck_ray.core import StepRecord

    rec = StepRecord(step=3, seed=4, projected_grad=0.5, lr=1e-3, eps=1e-3, fingerprint=1)
    log_err = pickle.loads(pickle.dumps(CorruptLogError("crc", "log/seg-000000000003.zlog", [rec])))
    assert (log_err.url, log_err.records) == ("log/seg-000000000003.zlog", [rec])
