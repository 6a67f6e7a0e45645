"""The shadow's pipeline without Ray: what is accepted is what is logged, a restarted shadow is
filled in by the trainer's publisher, and a storage outage delays durability without losing it."""

import pytest

from support import encode, trained, wait_until
from zocheck_ray.runtime.publisher import Publisher, PushReply, poll_answered
from zocheck_ray.runtime.errors import StageError
from zocheck_ray.runtime.shadow import Shadow
from zocheck_ray.config import JobConfig
from zocheck_ray.core import state_hash
from zocheck_ray.storage import SnapshotStore, read_log


@pytest.fixture
def job(tmp_path):
    return JobConfig(storage=str(tmp_path), shadow={"snapshot_interval": 4}, zo=dict(lr=1e-3, eps=1e-3))


def test_a_record_refused_in_the_middle_of_a_batch_leaves_exactly_the_accepted_ones_in_the_log(job):
    initial, opt, records = trained(job, 4)
    shadow = Shadow(job)
    try:
        shadow.initialize(0, initial)
        reply = shadow.push(encode([records[0], records[1], records[3], records[2]]))  # step 3 comes too early
        assert (reply.accepted, reply.next_step) == (3, 3)
        assert shadow.metrics().rejected_records == 1
        assert shadow.push(encode([records[3]])).accepted == 1
        shadow.drain(4, timeout=120)
        assert [r.step for r in read_log(job.run_url, after_step=-1)] == [0, 1, 2, 3]
        assert read_log(job.run_url, after_step=-1) == records
        assert shadow.replica_hash() == (4, state_hash(opt.state_tensors()))
    finally:
        shadow.close()


class SwitchableLink:
    """The trainer's link to whichever in-process shadow is alive; pushes to a dead one fail."""

    def __init__(self, shadow):
        self.shadow = shadow

    def push(self, data, trainer_step):
        if self.shadow is None:
            raise ConnectionError("the shadow process is gone")
        return self.shadow.push(data, trainer_step)

    poll = staticmethod(poll_answered)


def test_a_restarted_shadow_gets_what_it_lacks_from_the_publisher_and_ends_exact(job):
    initial, opt, records = trained(job, 20)
    first = Shadow(job)
    first.initialize(0, initial)
    link = SwitchableLink(first)
    publisher = Publisher(link, 0, trainer_step=lambda: 20)
    for record in records[:10]:
        publisher.append(record)
    publisher.tick()
    first.drain(10, timeout=120)          # steps 0..9 durable: where a restart will come back
    publisher._last_contact = 0.0         # the next tick pings now instead of after PING_SECONDS
    publisher.tick()                      # ... and learns that 0..9 are durable: it lets them go
    assert publisher.held_records == 0
    first.close()
    link.shadow = None                    # the shadow process dies; the trainer goes on
    for record in records[10:]:
        publisher.append(record)
    publisher.tick()                      # lost in flight
    assert publisher.errors == 1 and publisher.held_records == 10
    second = Shadow(job)                  # Ray's restart: rebuilt from durable storage at step 10
    try:
        assert second.metrics().received_step == 10 and second.metrics().source == "durable"
        link.shadow = second
        publisher._last_contact = 0.0     # the next tick pings now instead of after PING_SECONDS
        publisher.tick()                  # the ping's reply shows step 10 expected: records 10..19 re-sent
        publisher.tick()
        assert publisher.resent_records == 10 and publisher.shadow_restarts_seen == 1
        assert publisher.gap is None
        second.drain(20, timeout=120)
        assert second.replica_hash() == (20, state_hash(opt.state_tensors()))
        oldest = SnapshotStore(job.run_url, create=False).committed()[-1].step
        assert oldest < 20  # retention collects the log below the oldest retained snapshot, not more
        assert read_log(job.run_url, after_step=oldest - 1) == records[oldest:]  # no gap in the durable log
    finally:
        second.close()


def test_a_publisher_reports_a_gap_it_cannot_fill():
    class Answering:
        def push(self, data, trainer_step):
            return PushReply("restarted", 3, 3, 0)

        poll = staticmethod(poll_answered)

    publisher = Publisher(Answering(), 7, trainer_step=lambda: 7)  # holds nothing before step 7
    publisher._last_contact = 0.0
    publisher.tick()
    publisher.tick()
    assert publisher.gap is not None and "step 3" in publisher.gap


@pytest.mark.slow  # S3 retries through an outage
def test_a_storage_outage_is_reported_retried_and_leaves_no_gap(private_s3, job):
    bucket = private_s3.new_bucket()
    job = job.model_copy(update=dict(storage=f"s3://{bucket}/runs", storage_options=private_s3.options(),
                                     durability=job.durability.model_copy(update={"log_seal_records": 4})))
    initial, opt, records = trained(job, 12)
    shadow = Shadow(job)
    try:
        shadow.initialize(0, initial)
        shadow.push(encode(records[:4]), 4)
        shadow.drain(4, timeout=120)
        private_s3.stop()
        reply = shadow.push(encode(records[4:12]), 12)     # ingest never waits for storage
        assert reply.accepted == 8
        assert shadow.replay.wait_replayed(12, timeout=120)
        assert wait_until(lambda: shadow.metrics().persist_failures > 0)  # the stage keeps trying, and says so
        m = shadow.metrics()
        assert m.persist_error and m.durable_step == 4 and m.undurable_steps == 8
        with pytest.raises(StageError, match="not durable"):
            shadow.drain(12, timeout=0.5)
        private_s3.start()
        m = shadow.drain(12, timeout=120)
        assert m.durable_step == 12 and m.durable_log_step == 11 and m.undurable_steps == 0
        assert m.persist_error is None and m.persist_failures >= 1
        oldest = SnapshotStore(job.run_url, job.storage_options, create=False).committed()[-1].step
        assert oldest <= 4  # the log from the oldest retained snapshot on is whole
        assert read_log(job.run_url, after_step=oldest - 1, storage_options=job.storage_options) == records[oldest:]
        assert shadow.replica_hash() == (12, state_hash(opt.state_tensors()))
    finally:
        shadow.close()


def test_every_numeric_metric_is_a_gauge_and_status_shows_the_stage_errors(job):
    from zocheck_ray.runtime.messages import ShadowMetrics, numeric_fields

    shadow = Shadow(job, persist=False)
    try:
        m = shadow.metrics()
    finally:
        shadow.close()
    gauges = numeric_fields(m)
    numeric = {name for name, field in ShadowMetrics.model_fields.items()
               if field.annotation in (int, float, bool, int | None, float | None)}
    assert numeric - {name for name, value in m.model_dump().items() if value is None} == set(gauges)
    assert {"lag_steps", "undurable_steps", "persist_failures", "persist_failing_seconds", "rejected_records",
            "resync_count", "persist_in_flight"} <= set(gauges)
    assert {"ingest_error", "replay_error", "persist_error", "incarnation"} <= set(m.model_dump())


def test_replies_to_earlier_pushes_never_cause_a_resend(job):
    """Two pushes in flight: the first one's reply expects fewer records than were sent by then."""
    initial, opt, records = trained(job, 10)
    shadow = Shadow(job, persist=False)

    class SlowReplies:
        polls = 0

        def push(self, data, trainer_step):
            return shadow.push(data, trainer_step)

        def poll(self, handles):
            self.polls += 1
            return [] if self.polls == 1 else poll_answered(handles)

    try:
        shadow.initialize(0, initial)
        publisher = Publisher(SlowReplies(), 0, trainer_step=lambda: 10)
        for record in records[:5]:
            publisher.append(record)
        publisher.tick()                  # push 0 in flight, its reply not yet read
        for record in records[5:]:
            publisher.append(record)
        publisher.tick()                  # push 1 sent; then both replies: 5 expected, then 10
        assert publisher.resent_records == 0 and shadow.metrics().rejected_records == 0
        shadow.drain(10, timeout=120)
        assert shadow.replica_hash() == (10, state_hash(opt.state_tensors()))
    finally:
        shadow.close()


def test_a_second_shadow_on_a_live_run_is_refused_with_the_holder_named(job):
    from zocheck_ray.storage import LeaseHeldError

    first = Shadow(job, writer="shadow:first")
    try:
        with pytest.raises(LeaseHeldError, match="shadow:first"):
            Shadow(job, writer="shadow:second")
    finally:
        first.close()
    Shadow(job, writer="shadow:second").close()  # released: the next writer gets in at once


def test_a_shadow_whose_lease_was_taken_over_stops_persisting_and_says_why(job):
    from dataclasses import replace

    from zocheck_ray.storage import Lease, LeaseLostError
    from zocheck_ray.storage.lease import generation_name

    initial, opt, records = trained(job, 4)
    shadow = Shadow(job, writer="shadow:first")
    intruder = None
    try:
        shadow.initialize(0, initial)
        shadow.lease.stop_heartbeat()      # as if the shadow hung: its lease goes stale ...
        info = shadow.lease.info
        shadow.lease.storage.write_atomic(generation_name(info.generation),
                                          replace(info, heartbeat_unix=info.heartbeat_unix - 3600).encode())
        intruder = Lease(job.run_url, owner="shadow:intruder").acquire()   # ... and another writer takes it
        with pytest.raises(LeaseLostError):
            shadow.lease.renew()           # what its heartbeat finds at the next beat
        shadow.push(encode(records), 4)
        with pytest.raises(StageError, match="another writer holds the run's storage.*shadow:intruder"):
            shadow.drain(4, timeout=120)
        m = shadow.metrics()
        assert m.persist_stopped and "shadow:intruder" in m.persist_error and m.durable_step == 0
    finally:
        shadow.close()
        if intruder is not None:
            intruder.release()
