"""One writer per run (issue 12): the lease in the run's storage, on local disk and on S3.

A second writer is refused with the holder named, a stale lease is taken over with a
log line, the old holder finds out, and cleanup never touches a live writer's save.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

from zocheck_ray.core import state_hash
from zocheck_ray.storage import (
    Lease,
    LeaseHeldError,
    LeaseLostError,
    LeaseRequiredError,
    SnapshotStore,
    StepLog,
    check_no_live_writer,
    read_lease,
)
from zocheck_ray.storage.fs import TMP_MARK, open_storage
from zocheck_ray.storage.lease import LeaseInfo, generation_name
from zocheck_ray.storage.snapshot import MANIFEST_FILE, SNAPSHOTS_DIR, snapshot_dir


def make_state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 8), float(step)), "b": torch.arange(8, dtype=torch.float32) + step}


def age_heartbeat(lease: Lease, seconds: float) -> None:
    """Rewrite the holder's lease object as if its last heartbeat were `seconds` ago (a dead holder)."""
    info = read_lease(lease.storage)
    old = LeaseInfo(**{**info.__dict__, "heartbeat_unix": time.time() - seconds})
    lease.storage.write_atomic(generation_name(info.generation), old.encode())


def test_of_writers_racing_to_create_an_object_exactly_one_succeeds(root):
    url, options = root
    storage = open_storage(url, options)
    storage.make_dirs("lease")
    results: dict[int, bool] = {}
    writers = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, storage.create_exclusive("lease/object.json", f"writer {i}".encode()))) for i in range(8)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert sorted(results.values()) == [False] * 7 + [True]
    winner = next(i for i, created in results.items() if created)
    assert storage.read_bytes("lease/object.json") == f"writer {winner}".encode()
    assert not storage.create_exclusive("lease/object.json", b"late")
    assert [n for n in storage.list_dir("lease") if TMP_MARK in n] == []


def test_a_second_writer_is_refused_with_the_holder_named(root):
    url, options = root
    first = Lease(url, options, owner="shadow:run-1").acquire()
    second = Lease(url, options, owner="shadow:run-1-again")
    with pytest.raises(LeaseHeldError) as err:
        second.acquire()
    message = str(err.value)
    assert "'shadow:run-1'" in message and f"pid {os.getpid()}" in message and "generation 1" in message
    assert "heartbeat" in message and "s ago" in message
    assert err.value.holder.owner == "shadow:run-1" and err.value.holder.token == first.token
    assert not second.held and first.held
    with pytest.raises(LeaseRequiredError, match="never acquired"):
        StepLog(url, options, lease=second)


def test_a_stale_lease_is_taken_over_with_a_log_line_and_the_old_holder_learns_it(root, caplog):
    url, options = root
    old = Lease(url, options, owner="shadow:run-1").acquire()
    age_heartbeat(old, 3600)  # its process died an hour ago, as far as the store can tell
    with caplog.at_level(logging.WARNING, logger="zocheck_ray.storage.lease"):
        new = Lease(url, options, owner="shadow:run-1-restarted").acquire()
    assert new.generation == 2 and read_lease(new.storage).owner == "shadow:run-1-restarted"
    assert "took over the lease of owner 'shadow:run-1'" in caplog.text and "generation 2" in caplog.text
    with pytest.raises(LeaseLostError, match="now held by owner 'shadow:run-1-restarted'"):
        old.renew()
    assert not old.held
    with pytest.raises(LeaseLostError):
        SnapshotStore(url, options, lease=old)
    assert [g for g in old.storage.list_dir("lease")] == [os.path.basename(generation_name(2))]


def test_a_writer_that_lost_its_lease_commits_nothing(tmp_path):
    url = str(tmp_path / "run")
    lease = Lease(url, owner="writer").acquire()
    store = SnapshotStore(url, lease=lease)
    log = StepLog(url, lease=lease)
    store.save(1, make_state(1))
    age_heartbeat(lease, 3600)
    Lease(url, owner="usurper").acquire()
    with pytest.raises(LeaseLostError):
        lease.renew()
    with pytest.raises(LeaseLostError):
        store.save(2, make_state(2))
    with pytest.raises(LeaseLostError):
        log.flush()
    assert [i.step for i in SnapshotStore(url, create=False).committed()] == [1]


def test_a_lease_not_renewed_in_time_counts_as_lost_without_any_io(tmp_path):
    lease = Lease(str(tmp_path / "run"), lease_seconds=0.05).acquire()
    while lease.held:  # the holder cannot renew (say the store is down): after lease_seconds it must stop
        time.sleep(0.01)
    with pytest.raises(LeaseLostError, match="not renewed for"):
        lease.check()


def test_release_lets_the_next_writer_in_at_once(root):
    url, options = root
    with Lease(url, options, owner="first") as first:
        assert first.generation == 1
    assert read_lease(first.storage).released
    second = Lease(url, options, owner="second").acquire()
    assert second.generation == 2 and second.held


def test_reclaim_takes_a_fresh_lease_of_the_same_owner_only(tmp_path):
    url = str(tmp_path / "run")
    Lease(url, owner="shadow:run-1").acquire()  # a shadow process Ray has since restarted
    with pytest.raises(LeaseHeldError):
        Lease(url, owner="shadow:run-1").acquire()  # without reclaim a fresh lease is never taken
    restarted = Lease(url, owner="shadow:run-1").acquire(reclaim=True)
    assert restarted.generation == 2
    with pytest.raises(LeaseHeldError, match="'shadow:run-1'"):
        Lease(url, owner="someone-else").acquire(reclaim=True)


def test_acquire_can_wait_for_a_dead_holders_lease_to_go_stale(tmp_path):
    url = str(tmp_path / "run")
    Lease(url, owner="dead", lease_seconds=0.2).acquire()  # never renewed: stale 0.2 s later
    lease = Lease(url, owner="next").acquire(wait_seconds=30)
    assert lease.generation == 2


def test_racing_writers_get_one_lease(root):
    url, options = root
    leases = [Lease(url, options, owner=f"writer-{i}") for i in range(4)]
    barrier = threading.Barrier(len(leases))
    outcome: dict[int, str] = {}

    def contend(i: int) -> None:
        barrier.wait()
        try:
            leases[i].acquire()
            outcome[i] = "won"
        except LeaseHeldError:
            outcome[i] = "refused"

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(leases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, result in outcome.items() if result == "won"]
    assert len(winners) == 1 and len(outcome) == len(leases)
    assert read_lease(leases[0].storage).token == leases[winners[0]].token


def test_the_heartbeat_renews_until_release(tmp_path):
    url = str(tmp_path / "run")
    lease = Lease(url, lease_seconds=3.0).acquire()
    first = read_lease(lease.storage).heartbeat_unix
    lease.start_heartbeat()
    deadline = time.monotonic() + 30
    while read_lease(lease.storage).heartbeat_unix == first:
        assert time.monotonic() < deadline, "no heartbeat was written"
        time.sleep(0.05)
    assert lease.held and lease.last_error is None
    lease.release()
    assert read_lease(lease.storage).released and not lease.held


def test_a_live_writers_save_in_progress_survives_a_second_opener(root):
    url, options = root
    lease = Lease(url, options, owner="shadow:run-1").acquire()
    writer = SnapshotStore(url, options, lease=lease)
    writer.save(1, make_state(1))
    storage = writer.storage
    at_commit, resume = threading.Event(), threading.Event()
    real_write_atomic = storage.write_atomic

    def paused_write_atomic(rel: str, data: bytes):
        if rel.endswith(MANIFEST_FILE):  # every data file of step 2 is written; the commit waits
            at_commit.set()
            resume.wait()
        return real_write_atomic(rel, data)

    storage.write_atomic = paused_write_atomic
    saving = threading.Thread(target=writer.save, args=(2, make_state(2)))
    saving.start()
    assert at_commit.wait(60)
    in_progress = set(storage.list_dir(snapshot_dir(2)))
    assert in_progress and MANIFEST_FILE not in in_progress

    SnapshotStore(url, options)  # a second opener without the lease removes nothing
    with pytest.raises(LeaseHeldError, match="'shadow:run-1'"):
        SnapshotStore(url, options, lease=Lease(url, options, owner="second").acquire())
    with pytest.raises(LeaseRequiredError, match="remove uncommitted snapshots"):
        SnapshotStore(url, options).clean_uncommitted()
    assert set(storage.list_dir(snapshot_dir(2))) == in_progress

    resume.set()
    saving.join()
    reader = SnapshotStore(url, options, create=False)
    assert [i.step for i in reader.committed()] == [2, 1]
    tensors, _ = reader.load(2)
    assert state_hash(tensors) == state_hash(make_state(2))


def test_the_lease_holder_cleans_a_dead_writers_leftovers(root):
    url, options = root
    dead = Lease(url, options, owner="shadow:run-1").acquire()
    SnapshotStore(url, options, lease=dead).save(1, make_state(1))
    leftover = f"{snapshot_dir(2)}/model.safetensors"
    dead.storage.make_dirs(snapshot_dir(2))
    dead.storage.write_atomic(leftover, b"half a snapshot")
    age_heartbeat(dead, 3600)
    lease = Lease(url, options, owner="shadow:run-1-restarted").acquire()
    store = SnapshotStore(url, options, lease=lease)
    assert store.storage.list_dir(SNAPSHOTS_DIR) == [os.path.basename(snapshot_dir(1))]


def test_a_lease_of_another_run_is_refused(tmp_path):
    lease = Lease(str(tmp_path / "a")).acquire()
    with pytest.raises(ValueError, match="the lease is of .*a, not of .*b"):
        SnapshotStore(str(tmp_path / "b"), lease=lease)
    with pytest.raises(ValueError, match="lease_seconds must be > 0"):
        Lease(str(tmp_path / "a"), lease_seconds=0)


def test_a_driver_can_check_for_a_live_writer_before_starting_one(root):
    url, options = root
    assert check_no_live_writer(url, options) is None  # nothing there yet
    lease = Lease(url, options, owner="shadow:run-1").acquire()
    with pytest.raises(LeaseHeldError, match="'shadow:run-1'"):
        check_no_live_writer(url, options)
    lease.release()
    assert check_no_live_writer(url, options).released
