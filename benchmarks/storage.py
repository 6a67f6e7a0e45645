"""`python -m benchmarks storage`: snapshot saves and log appends against plain writes, locally and on S3.

    python -m benchmarks storage --json benchmarks/results/storage.json

Measures, in one run and on the same bytes:

- snapshot save against a plain fsspec write of the state's raw bytes, under the same
  durability policy: locally the baseline is written and fsync'd once (a save fsyncs each
  file once, then commits its manifest); on S3 (moto served by a separate process on
  127.0.0.1, as a remote endpoint would be) both are plain uploads, durable once the
  PUT or multipart upload completes. A save includes everything a caller waits for: the
  safetensors files, the SHA-256 of every file, the `state_hash` of the state, the fsyncs,
  the manifest commit and the retention of the newest two snapshots. Load (every hash
  verified) is shown beside a plain read;
- `StepLog.append` cost per record under several flush/fsync policies.

Rounds interleave baseline and saves so that background load and writeback noise hits
both alike; every measurement starts after `os.sync()` and after the background deletion
of the previously pruned snapshot (on local disk retention deletes files off the save's
path, as the plain baseline's file is deleted outside its timing). Ratios are of medians;
the machine and its load average before and after each case are recorded with them, and
so is the CPU time each case cost this process: a save hashes the state once (the SHA-256
of each file, from which the `state_hash` follows), so on a machine whose cores are busy
with other work its wall-clock ratio falls towards the ratio of CPU costs, while the
baseline mostly waits on the disk.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch

from benchmarks.common import machine, print_table, write_json
from zocheck_ray.core import StepRecord, ZOCheckError
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


def _sha256_pass(state) -> str:
    h = hashlib.sha256()
    for t in state.values():
        data = raw_bytes(t)
        for a in range(0, len(data), CHUNK_BYTES):
            h.update(data[a : a + CHUNK_BYTES])
    return h.hexdigest()


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def bench_snapshots(target: str, url: str, options: dict | None, size_mb: int, repeats: int) -> dict:
    state = make_state(size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    storage = open_storage(url, options)
    fs, base = storage.fs, storage.local_path("") if storage.local else storage.url.removeprefix("s3://")
    store = SnapshotStore(url, options, keep=2)
    fsync = storage.local
    baseline = "plain_fsync" if fsync else "plain"
    samples: dict[str, list[float]] = {k: [] for k in ("plain", "plain_fsync", "save",
                                                       "background_delete", "sha256_pass", "plain_read", "load")}

    cpu: dict[str, list[float]] = {k: [] for k in samples}

    def timed(fn: Callable[[], object]) -> tuple[float, float]:
        """Wall seconds, and CPU seconds of this process (all threads, user + kernel)."""
        store.wait_for_deletions()
        os.sync()  # no dirty pages of the previous measurement are being written back
        cpu_start, start = _cpu_seconds(), time.perf_counter()
        fn()
        return time.perf_counter() - start, _cpu_seconds() - cpu_start

    def record(name: str, seconds: tuple[float, float]) -> None:
        if round_ > 0:  # the first round warms caches and is discarded
            samples[name].append(seconds[0])
            cpu[name].append(seconds[1])

    load_before = _load_average()
    for round_ in range(repeats + 1):
        plain = f"{base}/plain-{round_}.bin"
        record(baseline, timed(lambda: _plain_write(fs, plain, state, fsync=fsync)))
        record("save", timed(lambda: store.save(round_, state)))
        start = time.perf_counter()
        store.wait_for_deletions()  # the pruned snapshot's files, deleted after the save returned
        record("background_delete", (time.perf_counter() - start, 0.0))
        if fsync:
            record("plain", timed(lambda: _plain_write(fs, plain, state, fsync=False)))  # for reference only
        record("sha256_pass", timed(lambda: _sha256_pass(state)))  # a save makes one, beside its writes
        record("plain_read", timed(lambda: _plain_read(fs, plain, state)))
        record("load", timed(lambda: store.load(round_)))
        fs.rm_file(plain)
    store.close()
    result = {"target": target, "bytes": nbytes, "repeats": repeats, "baseline_key": baseline,
              "baseline": "plain fsspec write + one fsync" if fsync else "plain fsspec write (upload complete)",
              "load_average_before": load_before, "load_average_after": _load_average()}
    for key, values in samples.items():
        if values:
            result[f"{key}_s_median"] = round(statistics.median(values), 4)
            result[f"{key}_s_all"] = [round(v, 4) for v in values]
            if key not in ("background_delete", "sha256_pass"):
                result[f"{key}_MBps_median"] = round(nbytes / statistics.median(values) / 1e6, 1)
                result[f"{key}_cpu_s_median"] = round(statistics.median(cpu[key]), 4)
    result["save_vs_baseline"] = round(statistics.median(samples[baseline]) / statistics.median(samples["save"]), 3)
    result["save_vs_baseline_best"] = round(min(samples[baseline]) / min(samples["save"]), 3)
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


class _MotoProcess:
    """moto's S3 server in a process of its own on 127.0.0.1: its CPU time is not the client's."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto's S3 server did not start (pip install 'moto[server]')") from None
                time.sleep(0.1)
        self.options = {"endpoint_url": f"http://127.0.0.1:{self.port}", "key": "bench", "secret": "bench"}
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **self.options).mkdir("zocheck-bench")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def run(size_mb: int = 256, s3_size_mb: int = 64, repeats: int = 5, records: int = 200_000, s3: bool = True,
        json_path: str | None = None, directory: str | None = None) -> dict:
    if directory is not None:
        os.makedirs(directory, exist_ok=True)
    work = tempfile.mkdtemp(prefix="zocheck-bench-", dir=directory)
    recs = _records(records)
    out = {"benchmark": "storage", "machine": {**machine(), "load_average_at_start": _load_average()},
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
                server = _MotoProcess()
            except (ImportError, RuntimeError) as exc:
                out["s3_skipped"] = str(exc)
            else:
                out["snapshot"].append(bench_snapshots("s3", "s3://zocheck-bench/run", server.options, s3_size_mb,
                                                       repeats))
                out["log"].append(bench_log("s3", "s3://zocheck-bench/log", server.options, recs, None, True))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    out["machine"]["load_average_at_end"] = _load_average()
    report(out)
    write_json(json_path, out)
    return out


def report(out: dict) -> None:
    m = out["machine"]
    print(f"storage benchmark on {m['cpu_count']} CPUs ({m['cpu']}), {m['platform']}; load average "
          f"(1, 5, 15 min) {m['load_average_at_start']} at start, {m['load_average_at_end']} at end")
    print("snapshot save vs a plain fsspec write of the same bytes under the same durability policy, "
          "MB/s (medians)")
    print_table(out["snapshot"], [
        ("target", "target", "s"), ("bytes", "bytes", ",d"), ("plain_MBps_median", "plain write", ".0f"),
        ("plain_fsync_MBps_median", "plain+fsync", ".0f"), ("save_MBps_median", "save", ".0f"),
        ("save_vs_baseline", "save/baseline", ".2f"), ("save_vs_baseline_best", "(best)", ".2f"),
        ("plain_read_MBps_median", "plain read", ".0f"), ("load_MBps_median", "load", ".0f"),
    ])
    for row in out["snapshot"]:
        verdict = "met" if row["meets_target"] else "NOT met"
        print(f"{row['target']}: save/baseline {row['save_vs_baseline']:.2f} vs target >= {TARGET_SAVE_RATIO:.2f}: "
              f"{verdict} (baseline: {row['baseline']}; {row['repeats']} rounds; load average "
              f"{row['load_average_before'][0]} -> {row['load_average_after'][0]})")
    print("a save includes the SHA-256 of every file (the state_hash follows from them), the fsyncs, the manifest "
          "commit and retention")
    for row in out["snapshot"]:
        print(f"{row['target']} medians, seconds: baseline {row[row['baseline_key'] + '_s_median']:.3f}, "
              f"save {row['save_s_median']:.3f}, "
              f"one SHA-256 pass over the state {row['sha256_pass_s_median']:.3f} (a save makes one, beside "
              f"its writes), pruned snapshot deleted in the background "
              f"{row['background_delete_s_median']:.3f}; CPU seconds of this process: baseline "
              f"{row[row['baseline_key'] + '_cpu_s_median']:.3f}, save {row['save_cpu_s_median']:.3f}")
    print()
    print(f"step log append, microseconds per record (target < {TARGET_APPEND_US} buffered)")
    print_table(out["log"], [("target", "target", "s"), ("us_per_record", "us/record", ".2f"), ("policy", "policy", "s")])
    if "s3_skipped" in out:
        print(f"S3 skipped: {out['s3_skipped']}")


def run_cli(args: argparse.Namespace) -> int:
    for flag in ("size_mb", "s3_size_mb", "repeats", "records"):
        if getattr(args, flag) < 1:
            print(f"error: --{flag.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        run(size_mb=args.size_mb, s3_size_mb=args.s3_size_mb, repeats=args.repeats, records=args.records,
            s3=not args.no_s3, json_path=args.json, directory=args.dir)
    except ZOCheckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def register(bench) -> None:
    b = bench.add_parser("storage", help="snapshot save vs plain fsspec write, log append cost (local and S3)")
    b.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    b.add_argument("--size-mb", type=int, default=256, metavar="N", help="state size for local saves (default 256)")
    b.add_argument("--s3-size-mb", type=int, default=64, metavar="N",
                   help="state size for S3 saves against a local moto server (default 64)")
    b.add_argument("--repeats", type=int, default=5, metavar="R", help="measurements per case; medians reported")
    b.add_argument("--records", type=int, default=200_000, metavar="N", help="log records appended per case")
    b.add_argument("--no-s3", action="store_true", help="skip the S3 cases")
    b.add_argument("--dir", metavar="DIR", help="local directory to write in (default: a temporary one)")
    b.set_defaults(func=run_cli)
