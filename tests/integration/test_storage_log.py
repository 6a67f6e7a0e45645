"""The durable step log (DESIGN.md section 3): order across seals, torn tails, corruption, repair, GC."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from zocheck_ray.core import RecordSequenceError, StepRecord
from zocheck_ray.storage import CorruptLogError, Lease, LeaseRequiredError, StepLog, read_log
from zocheck_ray.storage.fs import open_storage
from zocheck_ray.storage.steplog import SEGMENT_MAGIC, list_segments, read_records


def record(step: int, extras: int = 0) -> StepRecord:
    return StepRecord(step=step, seed=(step * 0x9E3779B97F4A7C15 + 1) % 2**64, projected_grad=0.25 * (step % 13 - 6),
                      lr=1e-4 * (1 + step % 3), eps=1e-3, fingerprint=0xABCDEF,
                      optimizer="sparse-mezo" if extras else "zo-sgd",
                      extras=tuple(0.5 + i for i in range(extras)))


def records(first: int, count: int, extras: int = 0) -> list[StepRecord]:
    return [record(s, extras) for s in range(first, first + count)]


def log_path(tmp_path, name: str = "") -> str:
    return os.path.join(tmp_path, "run", "log", name)


def only_segment(tmp_path, suffix: str) -> str:
    names = [n for n in os.listdir(log_path(tmp_path)) if n.endswith(suffix)]
    assert len(names) == 1, names
    return log_path(tmp_path, names[0])


# ---------------------------------------------------------------------- order and durability


def test_records_across_many_seals_read_back_in_order(root):
    url, options = root
    written = records(0, 2500, extras=3)
    with StepLog(url, options, seal_records=97) as log:
        for r in written:
            log.append(r)
    assert read_log(url, -1, options) == written
    assert read_log(url, 1999, options) == written[2000:]
    assert read_log(url, 2499, options) == []
    segments = list_segments(StepLog(url, options).storage)
    assert len(segments) == 26 and all(s.sealed for s in segments)
    assert [s.first_step for s in segments] == list(range(0, 2500, 97))


def test_flush_makes_appended_records_durable_and_visible_locally(tmp_path):
    url = str(tmp_path / "run")
    log = StepLog(url, seal_records=1000)
    for r in records(0, 10):
        log.append(r)
    assert read_log(url, -1) == []  # buffered, not yet durable
    log.flush()
    assert log.durable_step == 9
    assert read_log(url, -1) == records(0, 10)


def test_on_an_object_store_records_are_durable_once_their_segment_is_sealed(s3_bucket):
    url, options = s3_bucket
    log = StepLog(url, options, seal_records=1000)
    for r in records(0, 10):
        log.append(r)
    log.flush()  # the segment is neither full nor old: nothing is uploaded, and nothing claimed durable
    assert log.durable_step is None and read_log(url, -1, options) == []
    log.seal()
    assert log.durable_step == 9
    assert read_log(url, -1, options) == records(0, 10)


def test_an_object_store_log_makes_few_objects_under_periodic_flushes(s3_bucket):
    import s3fs

    url, options = s3_bucket
    log = StepLog(url, options, seal_records=32, seal_seconds=3600)
    for r in records(0, 100):
        log.append(r)
        if r.step % 2:
            log.flush()  # as a shadow persisting every other step would
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    objects = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{url.removeprefix('s3://')}/log"))
    assert objects == ["seg-000000000000.zlog", "seg-000000000032.zlog", "seg-000000000064.zlog"]
    assert log.durable_step == 95  # 96..99 wait in memory for the next seal
    assert read_log(url, -1, options) == records(0, 96)
    log.close()
    assert read_log(url, -1, options) == records(0, 100)


def test_an_object_store_segment_is_sealed_by_age_at_a_flush(s3_bucket):
    url, options = s3_bucket
    log = StepLog(url, options, seal_records=10_000, seal_seconds=0.05)
    log.append(record(0))
    log.flush()
    assert log.durable_step is None
    deadline = time.monotonic() + 0.05
    while time.monotonic() <= deadline:  # the segment's age is what is checked, so let it pass
        time.sleep(0.01)
    log.flush()
    assert log.durable_step == 0 and read_log(url, -1, options) == [record(0)]


def test_a_segment_a_live_writer_seals_while_it_is_read_is_read_again(tmp_path):
    url = str(tmp_path / "run")
    log = StepLog(url, seal_records=1000)
    for r in records(0, 10):
        log.append(r)
    log.flush()
    reader = open_storage(url, create=False)
    read_bytes, raced = reader.read_bytes, []

    def sealed_meanwhile(rel):  # the writer seals (renames) the open segment right after the listing
        if not raced:
            raced.append(rel)
            log.close()
        return read_bytes(rel)

    reader.read_bytes = sealed_meanwhile
    assert read_records(reader, -1) == records(0, 10)
    assert raced[0].endswith(".open") and not list_segments(reader)[0].rel.endswith(".open")


def test_a_segment_is_sealed_by_age(tmp_path):
    log = StepLog(str(tmp_path / "run"), seal_seconds=0.05, seal_records=10_000)
    log.append(record(0))
    time.sleep(0.06)
    log.append(record(1))  # the segment is now old enough: sealed with both records
    log.append(record(2))
    log.flush()
    assert [(s.first_step, s.sealed) for s in list_segments(log.storage)] == [(0, True), (2, False)]
    assert log.read(-1) == records(0, 3)


def test_object_store_uploads_each_sealed_segment_as_one_object(s3_bucket):
    import s3fs

    url, options = s3_bucket
    log = StepLog(url, options, seal_records=4)
    for r in records(0, 10):
        log.append(r)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    prefix = url.removeprefix("s3://")
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{prefix}/log")) == [
        "seg-000000000000.zlog", "seg-000000000004.zlog"]  # records 8, 9 wait in memory
    log.close()
    assert read_log(url, -1, options) == records(0, 10)


def test_appends_must_follow_in_order(root):
    url, options = root
    log = StepLog(url, options)
    log.append(record(5))
    with pytest.raises(RecordSequenceError, match=r"expects step 6, got step 8"):
        log.append(record(8))
    with pytest.raises(RecordSequenceError, match="expects step 6, got step 5"):
        log.append(record(5))
    log.close()
    with pytest.raises(RecordSequenceError, match="expects step 6"):
        StepLog(url, options).append(record(7))


# ---------------------------------------------------------------------- torn tails and corruption


def test_a_torn_tail_of_the_open_segment_is_ignored(tmp_path):
    url = str(tmp_path / "run")
    log = StepLog(url)
    for r in records(0, 50):
        log.append(r)
    log.flush()
    path = only_segment(tmp_path, ".open")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 5)  # the last record was cut short by a crash
    assert read_log(url, -1) == records(0, 49)
    with open(path, "ab") as f:
        f.write(b"\0" * 40)  # space the file was extended by but never written
    assert read_log(url, -1) == records(0, 49)


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "open"])
def test_a_corrupt_record_in_the_middle_is_reported_with_its_segment(tmp_path, sealed):
    url = str(tmp_path / "run")
    log = StepLog(url, seal_records=100)
    for r in records(0, 150):
        log.append(r)
    log.flush()
    size = record(0).size
    path = log_path(tmp_path, "seg-000000000000.zlog" if sealed else "seg-000000000100.open")
    first = 0 if sealed else 100
    flip(path, len(SEGMENT_MAGIC) + 20 * size + 30)  # inside record first + 20
    with pytest.raises(CorruptLogError) as err:
        read_log(url, -1)
    assert err.value.url.endswith(os.path.basename(path))
    assert os.path.basename(path) in str(err.value)
    assert err.value.records == records(0, first + 20)


def test_a_sealed_segment_cut_short_is_corruption_not_a_torn_tail(tmp_path):
    url = str(tmp_path / "run")
    with StepLog(url, seal_records=10) as log:
        for r in records(0, 20):
            log.append(r)
    path = log_path(tmp_path, "seg-000000000000.zlog")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    with pytest.raises(CorruptLogError, match=r"seg-000000000000\.zlog ends inside a record"):
        read_log(url, -1)


def test_a_file_that_is_not_a_segment_is_named(tmp_path):
    url = str(tmp_path / "run")
    StepLog(url)
    with open(log_path(tmp_path, "seg-000000000000.zlog"), "wb") as f:
        f.write(b"PK\x03\x04 not a log")
    with pytest.raises(CorruptLogError, match=r"seg-000000000000\.zlog is not a step-log segment"):
        read_log(url, -1)


# ---------------------------------------------------------------------- reopening after a crash

APPENDER = """
import sys
from zocheck_ray.core import StepRecord
from zocheck_ray.storage import StepLog

log = StepLog(sys.argv[1], seal_records=64)
step = 0
while True:
    log.append(StepRecord(step=step, seed=step + 1, projected_grad=0.5, lr=1e-3, eps=1e-3, fingerprint=7))
    if step % 5 == 4:
        log.flush()
        sys.stdout.write(f"durable {step}\\n")  # one write: print's pieces may be split by the kill
        sys.stdout.flush()
    step += 1
"""


def test_a_killed_appender_loses_nothing_flushed_and_the_log_continues(tmp_path):
    script = tmp_path / "appender.py"
    script.write_text(APPENDER)
    url = str(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script), url], stdout=subprocess.PIPE, text=True, env=env)
    while True:
        line = proc.stdout.readline()
        if line.startswith("durable ") and int(line.split()[1]) >= 300:
            break
    proc.kill()
    proc.wait()
    durable = max(int(l.split()[1]) for l in [line, *proc.stdout.read().splitlines()] if l.startswith("durable "))
    proc.stdout.close()

    got = read_log(url, -1)
    assert [r.step for r in got] == list(range(len(got))) and len(got) - 1 >= durable
    with pytest.raises(LeaseRequiredError, match=r"seg-000000000\d+\.open"):
        StepLog(url)  # the open segment may be a live writer's: only the lease holder repairs it
    log = StepLog(url, lease=Lease(url).acquire())  # repairs: cut to whole records and sealed
    assert log.next_step == len(got)
    assert all(s.sealed for s in list_segments(log.storage))
    log.append(StepRecord(step=len(got), seed=1, projected_grad=0.0, lr=1e-3, eps=1e-3, fingerprint=7))
    log.close()
    assert [r.step for r in read_log(url, -1)] == list(range(len(got) + 1))


def test_resume_step_drops_later_records_and_damage(tmp_path):
    url = str(tmp_path / "run")
    with StepLog(url, seal_records=30) as log:
        for r in records(0, 100):
            log.append(r)
    flip(log_path(tmp_path, "seg-000000000060.zlog"), len(SEGMENT_MAGIC) + 15 * record(0).size + 40)  # step 75
    with pytest.raises(CorruptLogError) as err:
        read_log(url, -1)
    assert err.value.records == records(0, 75)  # a recovery gets the state at step 75 from these
    log = StepLog(url, resume_step=75, lease=Lease(url).acquire())  # ... continues there: 75.. redone
    assert log.next_step == 75 and log.durable_step == 74
    assert read_log(url, -1) == records(0, 75)
    for r in records(75, 5):
        log.append(r)
    log.close()
    assert read_log(url, -1) == records(0, 80)


def test_a_damaged_last_segment_stops_appends_until_a_resume_step_is_given(tmp_path):
    url = str(tmp_path / "run")
    with StepLog(url, seal_records=30) as log:
        for r in records(0, 100):
            log.append(r)
    flip(log_path(tmp_path, "seg-000000000090.zlog"), len(SEGMENT_MAGIC) + 5 * record(0).size + 40)  # step 95
    with pytest.raises(CorruptLogError, match=r"seg-000000000090\.zlog.*open the log with resume_step"):
        StepLog(url)
    with pytest.raises(LeaseRequiredError, match="cut the damaged end of .*seg-000000000090.zlog"):
        StepLog(url, resume_step=95)
    assert StepLog(url, resume_step=95, lease=Lease(url).acquire()).next_step == 95
    assert read_log(url, -1) == records(0, 95)


def test_reading_stops_at_a_gap(tmp_path, caplog):
    url = str(tmp_path / "run")
    with StepLog(url) as log:
        for r in records(0, 10):
            log.append(r)
    with StepLog(url, resume_step=20) as log:  # the state jumped ahead (a snapshot covers 10..19)
        for r in records(20, 10):
            log.append(r)
    with caplog.at_level(logging.WARNING, logger="zocheck_ray.storage"):
        assert read_log(url, -1) == records(0, 10)
    assert "gap" in caplog.text and "step 10 is missing" in caplog.text
    assert read_log(url, 19) == records(20, 10)
    assert read_log(url, 14) == []


def test_garbage_collection_keeps_every_record_from_the_given_step(root):
    url, options = root
    log = StepLog(url, options, seal_records=100)
    for r in records(0, 530):
        log.append(r)
    log.seal()
    removed = log.collect_garbage(keep_from_step=250)
    assert [u.rsplit("/", 1)[1] for u in removed] == ["seg-000000000000.zlog", "seg-000000000100.zlog"]
    assert read_log(url, 249, options) == records(250, 280)
    assert [s.first_step for s in list_segments(log.storage)] == [200, 300, 400, 500]


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="seal_records must be a positive integer"):
        StepLog(str(tmp_path / "run"), seal_records=0)
    with pytest.raises(ValueError, match="seal_seconds must be > 0"):
        StepLog(str(tmp_path / "run"), seal_seconds=0)
    with pytest.raises(ValueError, match="resume_step must be a non-negative integer"):
        StepLog(str(tmp_path / "run"), resume_step=-2)
    with pytest.raises(ValueError, match="after_step must be an integer >= -1"):
        read_log(str(tmp_path / "run"), -5)


def test_without_auto_seal_appends_never_write_and_flush_seals_what_is_due(s3_bucket):
    url, options = s3_bucket
    log = StepLog(url, options, seal_records=4, auto_seal=False)
    for r in records(0, 10):
        log.append(r)  # a seal is due after the fourth, but append leaves every write to flush
    assert read_log(url, -1, options) == [] and log.durable_step is None
    log.flush()
    assert log.durable_step == 9 and read_log(url, -1, options) == records(0, 10)
