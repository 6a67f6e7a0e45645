"""The shadow without Ray: ordering of records, snapshots at clean boundaries, recovery images,
the pipeline's stages, a restarted shadow filled in by the trainer's publisher, storage outages."""

import pytest
import torch

from support import trained, wait_until
from zocheck_ray.host.image import ImageLayout, SharedBuffer, copy_state
from zocheck_ray.host.memory import process_memory
from zocheck_ray.runtime.shadow import Shadow
from zocheck_ray.config import JobConfig
from zocheck_ray.core import replay, state_hash
from zocheck_ray.storage import snapshot_dir
from zocheck_ray.workload.models import trainable_parameters


@pytest.fixture
def job(tmp_path):
    return JobConfig(storage=str(tmp_path), shadow={"snapshot_interval": 4}, zo=dict(lr=1e-3, eps=1e-3))


def test_records_from_the_past_or_the_future_are_rejected_and_never_applied(job):
    initial, opt, records = trained(job, 6)
    shadow = Shadow(job)
    try:
        shadow.initialize(0, initial)
        assert shadow.push(b"".join(r.to_bytes() for r in records[:3])).accepted == 3
        assert shadow.push(records[5].to_bytes()).accepted == 0          # the future: a gap
        assert shadow.push(records[1].to_bytes()).accepted == 0          # the past: a repeat
        m = shadow.metrics()
        assert m.rejected_records == 2
        assert "step 1" in shadow.last_rejection and "past" in shadow.last_rejection
        assert shadow.push(b"".join(r.to_bytes() for r in records[3:])).accepted == 3
        assert shadow.replay.wait_replayed(6, timeout=60)
        step, digest = shadow.replica_hash()
        assert (step, digest) == (6, state_hash(opt.state_tensors()))
        # the controller's status is the metrics' own fields, without the stats
        status, m = shadow.status(), shadow.metrics()
        assert type(status) is type(m.status) and m.status.model_dump().items() <= m.model_dump().items()
        assert status.replayed_step == m.replayed_step == 6
        assert not hasattr(status, "rejected_records") and m.rejected_records == 2
    finally:
        shadow.close()


def test_snapshots_fall_on_multiples_of_n_and_recovery_images_are_exact(job):
    initial, opt, records = trained(job, 10)
    shadow = Shadow(job)
    try:
        shadow.initialize(0, initial)
        shadow.push(b"".join(r.to_bytes() for r in records))
        assert shadow.replay.wait_replayed(10, timeout=60)
        image, tail = shadow.recovery_view()
        m = shadow.metrics()
        # Boundaries 0, 4 and 8 each took a snapshot, or deferred it while the image was being persisted.
        assert m.snapshots_taken + m.snapshots_deferred == 3 and m.snapshots_taken >= 1
        assert image.step in (0, 4, 8) and [r.step for r in tail] == list(range(image.step, 10))
        assert image.step == 8 or m.snapshots_deferred >= 1
        state = {k: v.clone() for k, v in image.tensors().items()}
        replay(state, tail, job.zo, start_step=image.step)
        assert state_hash(state) == state_hash(opt.state_tensors())
        assert wait_until(lambda: shadow.metrics().durable_step == image.step)  # persisted in the background
        # the durable snapshot directory is a Hugging Face model directory
        from transformers import AutoModelForCausalLM
        from zocheck_ray.storage import snapshot_dir
        loaded = AutoModelForCausalLM.from_pretrained(f"{job.run_url}/{snapshot_dir(image.step)}")
        expected = image.tensors()
        for name, tensor in trainable_parameters(loaded):
            assert torch.equal(tensor.detach(), expected[name]), name
    finally:
        shadow.close()


def test_the_shadow_says_whether_its_last_snapshot_copied_into_memory_in_use_or_new_memory(job):
    """An image reused is memory already touched; one a borrower holds is never written again, so the next
    snapshot takes new memory, its pages faulted in as the copy goes (what `bench scale` compares with the
    plain copy of the same kind)."""
    initial, opt, records = trained(job, 3)
    shadow = Shadow(job)
    try:
        shadow.initialize(0, initial)
        m = shadow.metrics()
        assert m.snapshot_into_fresh_memory is True  # the replica was built for this state
        assert m.snapshot_seconds_median is None  # no copy into memory in use yet
        shadow.push(b"".join(r.to_bytes() for r in records[:2]))
        assert shadow.replay.wait_replayed(2, timeout=60)
        shadow.replay.snapshot_now(2)  # between boundaries (every 4): the newest image's memory is reused
        m = shadow.metrics()
        assert m.snapshot_into_fresh_memory is False and m.snapshot_seconds > 0
        assert m.snapshot_threads == 1  # the replay's threads (no profile: one)
        assert m.snapshot_seconds_median == m.snapshot_seconds  # one copy into memory in use so far
        touched = m.snapshot_seconds
        lent, _ = shadow.recovery_view(lend=True)  # a borrower reads the image of step 2
        assert lent.step == 2
        shadow.push(records[2].to_bytes())
        assert shadow.replay.wait_replayed(3, timeout=60)
        image = shadow.replay.snapshot_now(3)
        m = shadow.metrics()
        assert m.snapshot_into_fresh_memory is True  # beside the lent image, in new memory
        assert m.snapshot_seconds_median == touched  # a copy into new memory is not one of the median's samples
        assert image.buffer is not lent.buffer
        shadow.give_back(lent.token)
        step, digest = shadow.replica_hash()
        assert (step, digest) == (3, state_hash(opt.state_tensors()))
    finally:
        shadow.close()


class HeldReplay:
    """Shadow hooks whose replay applies nothing while `replay_stalled` is True (records wait in the ledger)."""

    replay_stalled = False

    def after_replay(self, steps: int) -> None:
        pass


def test_a_recovering_trainer_is_offered_a_snapshot_of_the_caught_up_replica_where_it_saves_a_replay(job):
    """`offer(fresh=True)` (a recovering trainer on the CPU): where the replica has replayed some of the records
    after the newest image, it replays the rest and is snapshotted, and the trainer copies the state and replays
    nothing. Where it has replayed none of them (the trainer would replay as many), cannot catch up, or
    persistence pins the image (a second image would break the budget), the offer is the newest image and the
    records after it, as `offer(fresh=False)` always is. So it is for a standby that holds the newest image
    (`held`) while the replica has records still to replay: the standby replays them at once."""
    initial, opt, records = trained(job, 8)
    hooks = HeldReplay()
    shadow = Shadow(job, hooks=hooks)

    def offered(fresh: bool, held: str | None = None):
        image, tail = shadow.offer(fresh, held)
        try:
            return image.step, [r.step for r in tail], state_hash(image.tensors())
        finally:
            shadow.give_back(image.token)

    def idle(step: int) -> bool:
        m = shadow.metrics()
        return m.durable_step == step and not m.persist_in_flight

    def state_after(steps: int) -> str:
        state = {k: v.clone() for k, v in initial.items()}
        replay(state, records[:steps], job.zo, start_step=0)
        return state_hash(state)

    try:
        shadow.initialize(0, initial)
        assert wait_until(lambda: idle(0))
        shadow.push(b"".join(r.to_bytes() for r in records[:2]))
        assert shadow.replay.wait_replayed(2, timeout=60)
        hooks.replay_stalled = True
        shadow.push(records[2].to_bytes())  # the replica lags one record of the three after the image
        assert offered(False)[:2] == (0, [0, 1, 2])
        assert offered(True)[:2] == (0, [0, 1, 2])  # its replay is held: it cannot catch up
        assert shadow.metrics().recovery_snapshots == 0

        hooks.replay_stalled = False  # caught up for the offer (if the replay thread has not done it first)
        assert offered(True) == (3, [], state_after(3))  # the state after step 3, bit for bit
        m = shadow.metrics()
        assert m.replayed_step == 3 and m.recovery_snapshots == 1 and m.snapshots_taken == 2  # the initial one
        assert offered(True) == (3, [], state_after(3))  # the image is the replica's step: nothing new to take

        hooks.replay_stalled = True
        shadow.push(records[3].to_bytes())  # none of the records after the image replayed: the trainer would
        assert offered(True)[:2] == (3, [3])  # replay as many, and a standby holding the image copies nothing
        assert shadow.metrics().recovery_snapshots == 1
        hooks.replay_stalled = False

        assert shadow.replay.wait_replayed(4, timeout=60) and wait_until(lambda: idle(4))  # a boundary, persisted
        pinned = shadow.ledger.pin(None)  # persistence reads the image: it is not written while it does
        try:
            shadow.push(records[4].to_bytes())
            assert shadow.replay.wait_replayed(5, timeout=60)
            assert offered(True)[:2] == (4, [4])
            assert shadow.metrics().recovery_snapshots == 1
        finally:
            shadow.ledger.unpin(pinned)

        catch_ups = []  # the shadow's calls for a caught-up snapshot, counted
        snapshot_caught_up = shadow.replay.snapshot_caught_up
        shadow.replay.snapshot_caught_up = lambda: catch_ups.append(1) or snapshot_caught_up()
        held = shadow.ledger.image.token  # the image of step 4, held by a standby; the replica is caught up
        assert offered(True, held) == (5, [], state_after(5))  # two copies, where the standby would replay one
        assert catch_ups == [1] and shadow.metrics().recovery_snapshots == 2

        shadow.push(records[5].to_bytes())
        assert shadow.replay.wait_replayed(6, timeout=60)
        hooks.replay_stalled = True
        shadow.push(records[6].to_bytes())  # replayed one of the two records after the image, one waits
        held = shadow.ledger.image.token  # the image of step 5
        assert offered(True, held)[:2] == (5, [5, 6])  # the standby replays both: nothing asked of the replica
        assert catch_ups == [1] and shadow.metrics().recovery_snapshots == 2
        assert offered(True)[:2] == (5, [5, 6]) and catch_ups == [1, 1]  # a trainer holding nothing asks
        hooks.replay_stalled = False
        assert shadow.replay.wait_replayed(7, timeout=60)
        assert wait_until(lambda: not shadow.metrics().persist_in_flight)  # the image's memory is free to write
        assert offered(True, "an older image's token") == (7, [], state_after(7))
        assert shadow.metrics().recovery_snapshots == 3
    finally:
        shadow.close()


def test_a_new_shadow_over_the_same_storage_rebuilds_from_the_durable_image_and_log(job):
    initial, opt, records = trained(job, 7)
    first = Shadow(job)
    first.initialize(0, initial)
    first.push(b"".join(r.to_bytes() for r in records))
    assert wait_until(lambda: first.metrics().durable_step == 4 and first.metrics().durable_log_step == 6)
    # a fresh shadow read its process's resident memory before any state arrived: its memory is measured over it
    assert 0 < first.metrics().baseline_bytes <= process_memory()["VmHWM"]
    first.close()
    second = Shadow(job)  # as after a node loss
    try:
        m = second.metrics()
        assert m.source == "durable" and m.replayed_step == 7 and m.durable_step == 4
        assert m.baseline_bytes is None  # its state came first
        assert second.replica_hash() == (7, state_hash(opt.state_tensors()))
    finally:
        second.close()


def test_image_layout_round_trips_every_dtype_through_shared_memory():
    state = {"a": torch.randn(3, 5), "b": torch.randn(7).bfloat16(), "c": torch.randn(2, 3).half(),
             "d": torch.randn(1)}
    layout = ImageLayout.of(state)
    assert all(offset % 64 == 0 for offset in layout.offsets)
    buffer = SharedBuffer(layout.nbytes)
    try:
        copy_state(layout.views(buffer.bytes), state)
        back = {k: v.clone() for k, v in layout.views(buffer.bytes).items()}
    finally:
        buffer.close()
    assert list(back) == list(state)
    assert all(torch.equal(back[k], state[k]) and back[k].dtype == state[k].dtype for k in state)


def test_the_profiles_scratch_is_a_thirty_second_of_the_state_within_its_bounds():
    from zocheck_ray.runtime.replay import SCRATCH_BYTES, SCRATCH_MIN, ProfileScratch, scratch_limit
    from zocheck_ray.core import ZOConfig

    assert scratch_limit(1 << 20) == SCRATCH_MIN and scratch_limit(1 << 40) == SCRATCH_BYTES
    assert scratch_limit(4 << 20) == 128 << 10
    assert scratch_limit(256 << 20) == 8 << 20
    replica = {"a.weight": torch.empty(1024, 32 << 10), "b.weight": torch.empty(1024, 32 << 10)}  # 256 MiB
    scratch = ProfileScratch(replica, ZOConfig())
    assert scratch.bytes == 8 << 20 and scratch.fraction == 1 / 32
    adapter = {"lora_A": torch.zeros(64, 4096), "lora_B": torch.zeros(4096, 64)}  # 2 MiB: 1/32 is 64 KiB
    small = ProfileScratch(adapter, ZOConfig())
    assert small.bytes == SCRATCH_MIN and small.fraction == 1 / 32  # whole rows, within the limit
    assert ProfileScratch({"w": torch.zeros(1000, 10)}, ZOConfig()).fraction == 1.0  # 40 kB: all of it


SHADOW_WITHOUT_TRANSFORMERS = """
import json, sys
from safetensors.torch import load_file
from zocheck_ray.runtime.shadow import Shadow
from zocheck_ray.config import JobConfig

job = JobConfig.model_validate_json(open(sys.argv[1]).read())
loaded = load_file(sys.argv[2])
initial = {name: loaded[name] for name in json.loads(open(sys.argv[6]).read())}  # the optimizer's order
data = open(sys.argv[3], "rb").read()
cut = int(sys.argv[4])
config = json.loads(open(sys.argv[5]).read())
first = Shadow(job)
first.initialize(0, initial, model_config=config)
first.push(data[:cut])
first.drain(6)  # a snapshot of step 6, durable
first.close()
second = Shadow(job)  # rebuilt from durable storage: the config comes from the durable snapshot
second.push(data[cut:])
second.drain(10)
second.close()
print(json.dumps({"transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers")}))
"""


def test_the_shadow_never_imports_transformers_its_snapshots_carry_the_trainers_model_config(job, tmp_path):
    """A shadow's process holds the replica, not the model: the config its snapshots carry comes from the first
    trainer or from the durable snapshot it rebuilds from (transformers' import costs a shadow start seconds
    and its process hundreds of MB). Its snapshots stay Hugging Face model directories."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import save_file

    from support import REPO
    from zocheck_ray.storage import snapshot_dir
    from zocheck_ray.workload.models import model_config_dict

    initial, _,  records = trained(job, 10)
    paths = {name: tmp_path / name for name in ("job.json", "initial.safetensors", "records.bin", "config.json",
                                                     "order.json")}
    paths["job.json"].write_text(job.model_dump_json())
    save_file(initial, paths["initial.safetensors"])
    paths["order.json"].write_text(json.dumps(list(initial)))
    data = [r.to_bytes() for r in records]
    paths["records.bin"].write_bytes(b"".join(data))
    config = model_config_dict(job.model)
    paths["config.json"].write_text(json.dumps(config))
    args = [str(paths["job.json"]), str(paths["initial.safetensors"]), str(paths["records.bin"]),
            str(sum(map(len, data[:6]))), str(paths["config.json"]), str(paths["order.json"])]
    out = subprocess.run([sys.executable, "-c", SHADOW_WITHOUT_TRANSFORMERS, *args],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {"transformers": []}
    # the rebuilt shadow's (the first one's were collected: retention keeps two); were the first one's
    # without the config, the rebuilt shadow would have had to build it, and import transformers
    written = json.loads((tmp_path / job.run_id / snapshot_dir(10) / "config.json").read_text())
    assert written == json.loads(json.dumps(config))  # (id2label: JSON keys are strings)


def test_the_best_dev_step_s_snapshot_is_pinned_against_retention_and_loads_to_that_step(job):
    """With dev rows every evaluation step gets a durable snapshot, held until its dev loss is told; the lowest
    (MeZO's `load_best_model_at_end`) is pinned in retention.json, so retention, which keeps the newest two,
    never deletes it, and a shadow rebuilt from storage knows it."""
    from zocheck_ray.storage import SnapshotStore
    from zocheck_ray.storage.retention import read_retention

    job = job.model_copy(update={"steps": 13, "task": job.task.model_copy(
        update={"num_train": 8, "num_dev": 4, "eval_interval": 3})})
    initial, opt, records = trained(job, 13)
    shadow = Shadow(job)
    try:
        shadow.initialize(0, initial)
        shadow.push(b"".join(r.to_bytes() for r in records))
        assert shadow.replay.wait_replayed(13, timeout=60)
        store = SnapshotStore(job.run_url, create=False)
        # every evaluation step's snapshot is durable and held (replay waited for each), undecided yet
        assert wait_until(lambda: {3, 6, 9, 12} <= {i.step for i in store.committed()})
        shadow.note_dev({3: 0.5, 6: 0.7, 9: 0.6, 12: 0.5}, through=12)  # 3 and 12 tie: the first is MeZO's
        m = shadow.drain(13)
        assert (m.best_dev_step, m.best_dev_loss) == (3, 0.5)
        assert m.best_dev_snapshot == f"{job.run_url}/{snapshot_dir(3)}"
        assert [i.step for i in store.committed()] == [13, 12, 3]  # the newest two, and the pinned best
        assert read_retention(store.storage).pins == {"best_dev": 3}
        shadow.note_dev({13: 0.6}, through=13)
        m = shadow.drain(13)
        assert [i.step for i in store.committed()] == [13, 12, 3] and m.best_dev_step == 3
        assert shadow.replica_hash() == (13, state_hash(opt.state_tensors()))  # the run's state is unchanged
    finally:
        shadow.close()
    rebuilt = Shadow(job)  # as after a node loss: the pin is durable, retention at its start keeps it
    try:
        m = rebuilt.metrics()
        assert (m.best_dev_step, m.best_dev_snapshot) == (3, f"{job.run_url}/{snapshot_dir(3)}")
        # its image is at step 13, an evaluation step durable already: no longer held, so replay goes on
        assert wait_until(lambda: not rebuilt.ledger.image.hold)
        assert 3 in [i.step for i in SnapshotStore(job.run_url, create=False).committed()]
    finally:
        rebuilt.close()
    expected = {k: v.clone() for k, v in initial.items()}
    replay(expected, records[:3], job.zo, start_step=0)
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(m.best_dev_snapshot)
    for name, tensor in trainable_parameters(loaded):
        assert torch.equal(tensor.detach(), expected[name]), name


def test_a_rebuilt_shadow_saves_the_pinned_step_whose_snapshot_was_lost_with_its_predecessor(job):
    """The pin names step 3, but its snapshot never became durable (the shadow was lost first) and the log runs
    past it from step 0: the rebuild replays to step 3, saves it there, pinned, and goes on to the log's end."""
    from zocheck_ray.storage import SnapshotStore, StepLog
    from zocheck_ray.storage.retention import Retention

    job = job.model_copy(update={"steps": 6, "task": job.task.model_copy(
        update={"num_train": 8, "num_dev": 4, "eval_interval": 3})})
    initial, opt, records = trained(job, 5)
    with SnapshotStore(job.run_url) as store:
        store.save(0, initial, {"run_id": job.run_id, "zo_config": job.zo.model_dump(mode="json")})
        store.storage.write_atomic("retention.json", Retention(pins={"best_dev": 3}, released_through=3).encode())
    log = StepLog(job.run_url)
    for record in records:
        log.append(record)
    log.close()
    shadow = Shadow(job)
    try:
        m = shadow.metrics()
        assert (m.replayed_step, m.best_dev_step) == (5, 3)
        assert m.best_dev_snapshot == f"{job.run_url}/{snapshot_dir(3)}"
        assert shadow.replica_hash() == (5, state_hash(opt.state_tensors()))
    finally:
        shadow.close()
    expected = {k: v.clone() for k, v in initial.items()}
    replay(expected, records[:3], job.zo, start_step=0)
    tensors, _ = SnapshotStore(job.run_url, create=False).load(3)
    assert all(torch.equal(tensors[name], expected[name]) for name in expected)
