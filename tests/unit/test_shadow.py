"""The shadow without Ray: ordering of records, snapshots at clean boundaries, recovery images,
the pipeline's stages, a restarted shadow filled in by the trainer's publisher, storage outages."""

import pytest
import torch

from support import trained, wait_until
from zocheck_ray.actors.image import ImageLayout, SharedBuffer, copy_state
from zocheck_ray.actors.shadow import Shadow
from zocheck_ray.config import JobConfig
from zocheck_ray.core import replay, state_hash
from zocheck_ray.workload.models import trainable_parameters


@pytest.fixture
def job(tmp_path):
    return JobConfig(storage=str(tmp_path), snapshot_interval=4, zo=dict(lr=1e-3, eps=1e-3))


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


def test_a_new_shadow_over_the_same_storage_rebuilds_from_the_durable_image_and_log(job):
    initial, opt, records = trained(job, 7)
    first = Shadow(job)
    first.initialize(0, initial)
    first.push(b"".join(r.to_bytes() for r in records))
    assert wait_until(lambda: first.metrics().durable_step == 4 and first.metrics().durable_log_step == 6)
    first.close()
    second = Shadow(job)  # as after a node loss
    try:
        m = second.metrics()
        assert m.source == "durable" and m.replayed_step == 7 and m.durable_step == 4
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
    from zocheck_ray.actors.stages import SCRATCH_BYTES, SCRATCH_MIN, ProfileScratch, scratch_limit
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
