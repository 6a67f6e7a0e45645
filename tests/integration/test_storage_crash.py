"""Crash consistency (DESIGN.md section 8): nothing committed is lost, nothing torn is loaded.

A writer process (a fork of the test's) killed with SIGKILL at many points during saves, and an S3 endpoint
stopped in the middle of a save (or a log upload) and restarted.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch

from zocheck_ray.core import StepRecord, state_hash
from zocheck_ray.storage import Lease, SnapshotStore, StepLog, StorageError, read_log
from zocheck_ray.storage.snapshot import MANIFEST_FILE, snapshot_dir

# The writer's state for a step: 20 MB in three tensors (two dtypes, model and optimizer files), different
# at every step.
_gen = torch.Generator().manual_seed(7)
BASE = {
    "model.w1": torch.randn(1 << 21, generator=_gen),
    "model.w2": torch.randn(1 << 21, generator=_gen).bfloat16(),
    "optimizer.exp_avg.model.w1": torch.randn(1 << 21, generator=_gen),
}


def make(step: int) -> dict[str, torch.Tensor]:
    for t in BASE.values():  # in place: the state of one step at a time
        t[0] = step
        t[-1] = -step
    return BASE


def start_writer(root: str, step: int):
    """A writer process saving a snapshot a step from `step` on, until it is killed: a fork of this process
    (torch and the storage already imported), which writes `ready`, then `committed <step>` after each save,
    a line in one write each, to a pipe (or `error <what>` if it fails). Returns (its pid, the pipe's reading
    end)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer; it never returns into the test process
        try:
            os.close(read)
            torch.set_num_threads(1)  # no thread pool of the parent's is used in the child
            store = SnapshotStore(root, keep=2)
            os.write(write, b"ready\n")
            while True:
                store.save(step, make(step))
                os.write(write, f"committed {step}\n".encode())
                step += 1
        except BaseException as exc:  # said to the test, whose check of the next line shows it
            os.write(write, f"error {exc!r}\n".encode())
        finally:
            os._exit(1)
    os.close(write)
    return pid, os.fdopen(read)


@pytest.mark.slow  # 12 killed writers
def test_sigkill_during_saves_never_exposes_a_torn_snapshot(tmp_path):
    root = str(tmp_path / "run")
    rng = random.Random(3)
    # Kills early in a first save, then (after a commit, so the test does not depend on how fast
    # this machine saves) at random points of the saves that follow.
    kills = [(0.0, False), (0.02, False), (0.05, False), (0.09, False), (0.14, False), (0.2, False)]
    kills += [(rng.uniform(0.0, 0.8), True) for _ in range(6)]
    next_step, last_printed, kills_after_commit = 0, -1, 0
    for delay, after_a_commit in kills:
        pid, out = start_writer(root, next_step)
        assert out.readline().strip() == "ready"
        lines = [out.readline()] if after_a_commit else []
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        lines += out.read().splitlines()
        printed = [int(line.split()[1]) for line in lines if line.startswith("committed ")]
        out.close()
        last_printed = max([last_printed, *printed])
        kills_after_commit += bool(printed)

        # A reader right after the crash, before any cleanup.
        reader = SnapshotStore(root, create=False)
        info = reader.latest()
        if last_printed >= 0:
            assert info is not None and info.step >= last_printed, "a committed snapshot was lost"
        for committed in reader.committed():
            tensors, _ = reader.load(committed)
            assert state_hash(tensors) == state_hash(make(committed.step)) == committed.state_hash
        next_step = info.step + 1 if info is not None else 0

    assert kills_after_commit >= 6
    store = SnapshotStore(root, lease=Lease(root).acquire())  # the run's writer removes what the kills left
    for name in store.storage.list_dir("snapshots"):
        assert MANIFEST_FILE in store.storage.list_dir(f"snapshots/{name}")
    assert len(store.committed()) == 2


# ---------------------------------------------------------------------- S3 outages


class StopBefore:
    """Passes storage calls through, stopping the S3 server just before the named operation."""

    def __init__(self, inner, server, operation: str):
        self._inner, self._server, self._operation = inner, server, operation

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name != self._operation:
            return attr

        def stopping(*args, **kwargs):
            self._server.stop()
            return attr(*args, **kwargs)

        return stopping


@pytest.mark.parametrize("operation", ["open_write", "write_atomic"], ids=["before-data", "before-commit"])
def test_s3_outage_between_objects_commits_nothing(private_s3, operation):
    url = f"s3://{private_s3.new_bucket()}/run"
    options = private_s3.options()
    first = {k: v.clone() for k, v in make(1).items()}
    store = SnapshotStore(url, options)
    store.save(1, first)
    store.storage = StopBefore(store.storage, private_s3, operation)
    with pytest.raises(StorageError, match=r"s3://.*/run/snapshots/step-000000000002/"):
        store.save(2, make(2))
    private_s3.start()

    reader = SnapshotStore(url, options, create=False)
    assert [i.step for i in reader.committed()] == [1]
    tensors, _ = reader.load(reader.latest())
    assert state_hash(tensors) == state_hash(first)
    writer = SnapshotStore(url, options, lease=Lease(url, options).acquire())  # restarted: step 2's debris goes
    assert writer.storage.list_dir("snapshots") == [os.path.basename(snapshot_dir(1))]
    writer.save(2, make(2))
    assert writer.latest().step == 2


@pytest.mark.parametrize("delay", [0.02, 0.1, 0.25])
def test_s3_outage_during_a_save_fails_cleanly_or_completes(private_s3, delay):
    url = f"s3://{private_s3.new_bucket()}/run"
    options = private_s3.options()
    expected = {1: state_hash(make(1)), 2: state_hash(make(2))}
    store = SnapshotStore(url, options)
    store.save(1, make(1))
    stopper = threading.Timer(delay, private_s3.stop)
    stopper.start()
    try:
        store.save(2, make(2))
        outcome = "completed"
    except StorageError:
        outcome = "failed"
    stopper.join()
    private_s3.start()

    reader = SnapshotStore(url, options, create=False)
    latest = reader.latest()
    assert latest.step == 2 if outcome == "completed" else latest.step in (1, 2)
    for info in reader.committed():
        tensors, _ = reader.load(info)  # whatever is visible is whole
        assert state_hash(tensors) == expected[info.step]


def test_s3_log_upload_during_an_outage_keeps_the_records_for_a_retry(private_s3):
    url = f"s3://{private_s3.new_bucket()}/run"
    log = StepLog(url, private_s3.options(), seal_records=1000)
    records = [StepRecord(step=i, seed=i + 1, projected_grad=0.5 * i, lr=1e-3, eps=1e-3, fingerprint=9)
               for i in range(10)]
    for r in records[:5]:
        log.append(r)
    private_s3.stop()
    with pytest.raises(StorageError, match=r"log/seg-000000000000\.zlog"):
        log.seal()
    private_s3.start()
    for r in records[5:]:
        log.append(r)
    log.seal()
    assert read_log(url, -1, private_s3.options()) == records


def test_appends_stay_cheap_and_silent_while_the_endpoint_is_down(private_s3, caplog):
    url = f"s3://{private_s3.new_bucket()}/run"
    log = StepLog(url, private_s3.options(), seal_records=4)
    records = [StepRecord(step=i, seed=i + 1, projected_grad=0.25, lr=1e-3, eps=1e-3, fingerprint=9)
               for i in range(10)]
    for r in records[:4]:
        log.append(r)  # the fourth seals the first segment while the endpoint is up
    private_s3.stop()
    for r in records[4:]:
        log.append(r)  # a seal is due but fails: the records stay buffered, appends go on
    assert "could not seal a segment" in caplog.text
    with pytest.raises(StorageError, match=r"log/seg-000000000004\.zlog"):
        log.flush()
    private_s3.start()
    log.flush()
    assert log.durable_step == 9
    assert read_log(url, -1, private_s3.options()) == records
