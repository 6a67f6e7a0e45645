"""The shadow holds two copies of the state, and nothing else of its size, in every phase of a run.

A model of a few hundred MB (an OPT saved with `save_pretrained`), one run through the
startup profile, snapshots, persistence, a trainer killed and recovered, the shadow killed
and rebuilt from durable storage, and the final drain: after every segment the shadow's own
accounting (`ShadowMetrics`: bytes by purpose and their peak in its process) stays within
the budget. Counts, not timings.
"""

import pytest
import ray
import torch
import transformers

from zocheck_ray.runtime.replay import scratch_limit
from zocheck_ray.config import JobConfig
from zocheck_ray.control import RunCallback
from zocheck_ray.testing import run_with_faults

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]

STEPS, FAIL_AT, SHADOW_KILLED_AT = 22, 12, 16


@pytest.fixture(scope="module")
def opt_directory(tmp_path_factory):
    """An OPT of about 51M parameters (205 MB in fp32), saved as a Hugging Face directory."""
    config = transformers.OPTConfig(vocab_size=50272, hidden_size=512, num_hidden_layers=8, ffn_dim=2048,
                                    num_attention_heads=8, max_position_embeddings=64, word_embed_proj_dim=512)
    config.architectures = ["OPTForCausalLM"]
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("opt-51m")
    transformers.OPTForCausalLM(config).save_pretrained(directory)
    return str(directory)


class Samples(RunCallback):
    """The shadow's metrics after every segment; kills the shadow's process once, at a segment's end."""

    def __init__(self, kill_at: int):
        self.metrics, self.kill_at, self.killed = [], kill_at, False

    def on_segment(self, run, segment):
        self.metrics.append(segment.metrics)
        if not self.killed and segment.progress.step >= self.kill_at:
            self.killed = True
            run.shadow.kill()  # Ray restarts it: rebuilt from durable storage


def test_the_shadow_holds_two_copies_of_the_state_through_a_whole_run(tmp_path, opt_directory):
    job = JobConfig(model=opt_directory, steps=STEPS, storage=str(tmp_path), log_interval=2, run_seed=1,
                    task=dict(batch_size=1, max_length=16, eval_size=1, eval_batch_size=1, eval_interval=10**6,
                              tokenizer="byte"))  # a directory saved without a tokenizer
    samples = Samples(kill_at=SHADOW_KILLED_AT)
    summary = run_with_faults(job, fail_at=[FAIL_AT], progress=None, callbacks=[samples])
    assert summary.final_state_hash == summary.shadow_state_hash
    (recovery,) = summary.recoveries
    assert recovery.failed_at_step == FAIL_AT and recovery.image_source == "memory"
    assert samples.killed and summary.shadow_restarts == 1  # the rebuild from storage is part of the run
    every = [*samples.metrics, summary.metrics]
    state = summary.metrics.state_bytes
    assert state > 200e6  # a few hundred MB: the state, not the process, dominates
    incarnations = {m.incarnation for m in every}
    assert len(incarnations) == 2  # both shadow processes were sampled
    for m in every:
        assert m.state_bytes == state
        assert state <= m.replica_bytes < state + (1 << 20), m  # the state, its tensors 64-byte aligned
        assert m.image_bytes == m.replica_bytes  # one image, the replica's size (aligned layout)
        assert m.held_bytes == m.replica_bytes + m.image_bytes + m.scratch_bytes
        assert m.peak_held_bytes <= 2 * m.replica_bytes + scratch_limit(state), m  # 1/32 of the state at most
    profiled = summary.profile is not None
    assert profiled and max(m.scratch_bytes for m in every) == 0  # the profile's scratch is gone after it
    assert summary.metrics.snapshots_taken >= 1 and summary.metrics.snapshots_persisted >= 1
