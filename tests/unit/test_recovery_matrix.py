"""Every optimizer x {full, LoRA, prefix} x {fp32, bf16} through three software failures and a host failure,
ending with the uninterrupted run's state hash at every step.

The trainer and the shadow run in this process (`testing.in_process`: the same `Trainer` and `Shadow` a Ray
run puts in two processes), so the whole matrix takes seconds; tests/integration/test_ray_recovery.py takes
one of its cells through real process deaths on Ray. The first shadow replays nothing (a shadow that has
fallen behind), so each software failure recovers from the initial image plus every record since, replayed
by the trainer, and the host failure rebuilds the shadow from the initial durable snapshot plus the durable
log, replayed by the shadow; the rebuilt shadow then keeps pace, snapshots and drains.
"""

import itertools
import json

import pytest

from zocheck_ray.config import JobConfig
from zocheck_ray.runtime.injection import FaultInjection
from zocheck_ray.testing.in_process import run_in_process
from zocheck_ray.testing.reference import uninterrupted_hashes

OPTIMIZERS = ["zo-sgd", "zo-adam", "sparse-mezo", "zo-sgd-sign", "zo-signsgd", "zo-sgd-mmt", "zo-sgd-cons"]
ADAPTERS = {"full": None, "lora": {"method": "lora", "r": 2, "lora_alpha": 4},
            "prefix": {"method": "prefix", "num_virtual_tokens": 3}}
STEPS, SOFTWARE, HOST = 12, [2, 5, 7], 9

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: see conftest


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Eight short rows for next-token loss: a task that builds in milliseconds, five times a run."""
    path = tmp_path_factory.mktemp("corpus") / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"row {i} of a small corpus"}) for i in range(8)) + "\n")
    return str(path)


def job_for(tmp_path, corpus, optimizer, adapter, dtype) -> JobConfig:
    return JobConfig.model_validate(dict(
        steps=STEPS, storage=str(tmp_path), shadow=dict(snapshot_interval=2, max_lag_steps=1000),
        durability=dict(durable_interval=4), log_interval=4, hash_every_step=True, dtype=dtype, peft=ADAPTERS[adapter],
        zo=dict(optimizer=optimizer, lr=5e-3, eps=1e-2, weight_decay=0.05, sparsity=0.5),
        task=dict(kind="lm", data_path=corpus, text_field="text", batch_size=2, max_length=16, eval_size=1,
                  eval_interval=1000)))


@pytest.mark.parametrize("optimizer,adapter,dtype", list(itertools.product(OPTIMIZERS, ADAPTERS, ["fp32", "bf16"])))
def test_three_software_failures_and_a_host_failure_end_exact(tmp_path, corpus, optimizer, adapter, dtype):
    job = job_for(tmp_path, corpus, optimizer, adapter, dtype)
    run = run_in_process(job, software=SOFTWARE, host=[HOST], first_shadow_hooks=FaultInjection(replay_stalled=True))
    expected = uninterrupted_hashes(job)
    assert sorted(run.step_hashes) == list(range(1, STEPS + 1))
    for step, seen in run.step_hashes.items():
        assert set(seen) == {expected[step]}, f"the state after step {step} differs"
    assert [r.source for r in run.recoveries] == ["memory"] * len(SOFTWARE) + ["durable"]
    assert all(r.state_hash == expected[r.step] for r in run.recoveries)
    assert max(r.replayed_records for r in run.recoveries) >= 3  # the trainer replayed what the shadow had not
    assert run.final_hash == expected[STEPS] and run.shadow == (STEPS, expected[STEPS])
    assert run.metrics.replay_error is None and run.metrics.persist_error is None


def test_a_reference_is_computed_once_for_what_it_depends_on(tmp_path, corpus, monkeypatch):
    """The uninterrupted run is computed once per process for the fields it reads: another run id or storage
    reuses it, another learning rate does not, and a job reading a data file is computed each time."""
    from zocheck_ray.testing import reference

    built = []
    real = reference._model_and_optimizer
    monkeypatch.setattr(reference, "_model_and_optimizer", lambda job: built.append(job.run_id) or real(job))
    task = dict(batch_size=2, max_length=16, eval_size=4)
    first = JobConfig(steps=2, storage=str(tmp_path / "a"), run_id="ref-a", task=task, zo=dict(lr=1e-3))
    again = first.model_copy(update={"storage": str(tmp_path / "b"), "run_id": "ref-b"})
    other_lr = JobConfig(steps=2, storage=str(tmp_path / "a"), run_id="ref-c", task=task, zo=dict(lr=2e-3))
    hashes = uninterrupted_hashes(first)
    assert uninterrupted_hashes(again) == hashes and built == ["ref-a"]
    assert uninterrupted_hashes(other_lr)[2] != hashes[2] and built == ["ref-a", "ref-c"]
    reads_a_file = job_for(tmp_path, corpus, "zo-sgd", "full", "fp32").model_copy(update={"steps": 1})
    uninterrupted_hashes(reads_a_file)
    uninterrupted_hashes(reads_a_file)
    assert built[2:] == [reads_a_file.run_id] * 2
