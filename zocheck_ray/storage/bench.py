"""The storage benchmark behind `zocheck-ray bench storage`.

    zocheck-ray bench storage --json benchmarks/results/storage.json

Measures, in one run and on the same bytes:

- snapshot save (`SnapshotStore.save`: safetensors + per-file SHA-256 + state_hash +
  fsync + atomic manifest commit + retention) against a plain fsspec write of the state's
  bytes, without and with an fsync (locally), and load (every hash verified) against a
  plain read; locally and against S3 served by moto on 127.0.0.1;
- `StepLog.append` cost per record under several flush/fsync policies.

Results are medians over `repeats`, interleaved so that page-cache and background
writeback noise hits baseline and candidate alike.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import statistics
import tempfile
import time
from typing import Callable

import torch

from zocheck_ray.bench.common import machine, print_table, write_json
from zocheck_ray.core import StepRecord
from zocheck_ray.storage.fs import open_storage
from zocheck_ray.storage.snapshot import SnapshotStore
from zocheck_ray.storage.steplog import StepLog
from zocheck_ray.storage.tensorfile import CHUNK_BYTES, raw_bytes

TARGET_SAVE_RATIO = 0.70
TARGET_APPEND_US = 5.0
TENSOR_MB = 16


def make_state(size_mb: int) -> dict[str, torch.Tensor]:
    """fp32 tensors of 16 MB (a mid-sized LLM layer each) adding up to `size_mb`."""
    gen = torch.Generator().manual_seed(0)
    n = max(1, size_mb // TENSOR_MB)
    return {f"model.layers.{i}.mlp.weight": torch.randn(TENSOR_MB << 18, generator=gen) for i in range(n)}


def _plain_write(fs, path: str, state, fsync: bool) -> None:
    with fs.open(path, "wb") as f:
        for t in state.values():
            data = raw_bytes(t)
            for a in range(0, len(data), CHUNK_BYTES):
                f.write(data[a : a + CHUNK_BYTES])
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def _plain_read(fs, path: str, state) -> None:
    with fs.open(path, "rb") as f:
        for t in state.values():
            target = torch.empty_like(t)
            view = raw_bytes(target)
            for a in range(0, len(view), CHUNK_BYTES):
                chunk = f.read(min(CHUNK_BYTES, len(view) - a))
                view[a : a + len(chunk)] = chunk


def _timed(fn: Callable[[], object]) -> float:
    os.sync()  # start each measurement with no dirty pages of the previous one being written back
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_snapshots(target: str, url: str, options: dict | None, size_mb: int, repeats: int) -> dict:
    state = make_state(size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    storage = open_storage(url, options)
    fs, base = storage.fs, storage.local_path("") if storage.local else storage.url.removeprefix("s3://")
    store = SnapshotStore(url, options, keep=2)
    samples: dict[str, list[float]] = {"plain": [], "plain_fsync": [], "save": [], "plain_read": [], "load": []}
    for i in range(repeats + 1):  # the first round warms caches and is discarded
        plain = f"{base}/plain-{i}.bin"
        rounds = {"plain": lambda: _plain_write(fs, plain, state, fsync=False),
                  "save": lambda: store.save(i, state)}
        if storage.local:
            rounds["plain_fsync"] = lambda: _plain_write(fs, plain, state, fsync=True)
        for name, fn in rounds.items():
            seconds = _timed(fn)
            if i:
                samples[name].append(seconds)
        read_seconds = _timed(lambda: _plain_read(fs, plain, state))
        load_seconds = _timed(lambda: store.load(i))
        if i:
            samples["plain_read"].append(read_seconds)
            samples["load"].append(load_seconds)
        fs.rm_file(plain)
    best = {k: nbytes / min(v) / 1e6 for k, v in samples.items() if v}
    median = {k: nbytes / statistics.median(v) / 1e6 for k, v in samples.items() if v}
    result = {"target": target, "bytes": nbytes, "repeats": repeats}
    for key, name in (("plain", "plain_write"), ("plain_fsync", "plain_write_fsync"), ("save", "save"),
                      ("plain_read", "plain_read"), ("load", "load")):
        if key in best:
            result[f"{name}_MBps"] = round(best[key], 1)
            result[f"{name}_MBps_median"] = round(median[key], 1)
    # Locally a save is fsync'd, so the like-for-like baseline is a write with an fsync.
    baseline = "plain_fsync" if "plain_fsync" in best else "plain"
    result["baseline"] = "plain fsspec write + fsync" if baseline == "plain_fsync" else "plain fsspec write"
    result["save_vs_baseline"] = round(best["save"] / best[baseline], 3)
    result["save_vs_baseline_median"] = round(median["save"] / median[baseline], 3)
    result["save_vs_plain_write"] = round(best["save"] / best["plain"], 3)
    result["meets_target"] = result["save_vs_baseline"] >= TARGET_SAVE_RATIO
    return result


def _records(n: int) -> list[StepRecord]:
    return [StepRecord(step=i, seed=(i * 0x9E3779B97F4A7C15) % 2**64, projected_grad=0.001 * (i % 97 - 48),
                       lr=1e-6, eps=1e-3, fingerprint=0x1234_5678_9ABC_DEF0) for i in range(n)]


def bench_log(target: str, url: str, options: dict | None, records: list[StepRecord], flush_every: int | None,
              fsync: bool, seal_records: int = 4096) -> dict:
    log = StepLog(url, options, seal_records=seal_records, seal_seconds=3600.0, fsync=fsync)
    start = time.perf_counter()
    for r in records:
        log.append(r)
        if flush_every and (r.step + 1) % flush_every == 0:
            log.flush()
    elapsed = time.perf_counter() - start
    log.close()
    policy = (f"append buffered, seal every {seal_records} records"
              + (f", flush every {flush_every}" if flush_every else ", no explicit flush")
              + (", fsync on flush/seal" if fsync and target == "local" else "")
              + ("; a flush or seal is one PUT" if target == "s3" else ""))
    us = elapsed / len(records) * 1e6
    return {"target": target, "policy": policy, "records": len(records), "us_per_record": round(us, 3),
            "meets_target": us < TARGET_APPEND_US if flush_every is None else None}


def _moto() -> tuple[object, dict]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "bench", "secret": "bench"}
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir("zocheck-bench")
    return server, options


def run(size_mb: int = 256, s3_size_mb: int = 64, repeats: int = 5, records: int = 200_000, s3: bool = True,
        json_path: str | None = None, directory: str | None = None) -> dict:
    work = tempfile.mkdtemp(prefix="zocheck-bench-", dir=directory)
    recs = _records(records)
    out = {"benchmark": "storage", "machine": machine(),
           "targets": {"save_vs_plain_write_min": TARGET_SAVE_RATIO, "append_us_per_record_max": TARGET_APPEND_US},
           "snapshot": [], "log": []}
    server = None
    try:
        local = os.path.join(work, "run")
        out["snapshot"].append(bench_snapshots("local", local, None, size_mb, repeats))
        for i, (flush_every, fsync) in enumerate([(None, True), (1000, True), (1, True)]):
            n = records if flush_every != 1 else min(records, 2000)
            out["log"].append(bench_log("local", os.path.join(work, f"log-{i}"), None, recs[:n], flush_every, fsync))
        if s3:
            try:
                server, options = _moto()
            except ImportError:
                out["s3_skipped"] = "moto[server] is not installed (pip install 'moto[server]')"
            else:
                out["snapshot"].append(bench_snapshots("s3", "s3://zocheck-bench/run", options, s3_size_mb, repeats))
                out["log"].append(bench_log("s3", "s3://zocheck-bench/log", options, recs, None, True))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(out)
    write_json(json_path, out)
    return out


def report(out: dict) -> None:
    m = out["machine"]
    print(f"storage benchmark on {m['cpu_count']} CPUs ({m['cpu']}), {m['platform']}")
    print("snapshot save and load vs plain fsspec I/O of the same bytes, MB/s (best of repeats)")
    print_table(out["snapshot"], [
        ("target", "target", "s"), ("bytes", "bytes", ",d"), ("plain_write_MBps", "plain write", ".0f"),
        ("plain_write_fsync_MBps", "plain+fsync", ".0f"), ("save_MBps", "save", ".0f"),
        ("save_vs_baseline", "save/baseline", ".2f"), ("save_vs_baseline_median", "(medians)", ".2f"),
        ("plain_read_MBps", "plain read", ".0f"), ("load_MBps", "load", ".0f"),
    ])
    print("baseline: plain write + fsync locally (a save is fsync'd), plain write on S3 (a PUT is durable)")
    print()
    print(f"step log append, microseconds per record (target < {TARGET_APPEND_US} buffered)")
    print_table(out["log"], [("target", "target", "s"), ("us_per_record", "us/record", ".2f"), ("policy", "policy", "s")])
    if "s3_skipped" in out:
        print(f"S3 skipped: {out['s3_skipped']}")
