"""A 4-bit base with LoRA and a QZO run on a CUDA trainer, each through a software failure and a host failure;
runs where CUDA and bitsandbytes are present (scripts/cuda_check.sh), skips elsewhere.

The recovered state must be the durable log's replay at every step (the exactness contract); where the GPU's
forward passes are deterministic it is also the uninterrupted CUDA run's, and the test says so when it is not.
"""

from types import SimpleNamespace

import pytest
import torch

from test_quantized import CELLS, corpus, job_for, llama_dir  # noqa: F401  (the fixtures)
from zocheck_ray.core import ZOOptimizer, state_hash
from zocheck_ray.runtime.injection import FaultInjection
from zocheck_ray.runtime.shadow import Shadow
from zocheck_ray.runtime.trainer import Trainer
from zocheck_ray.testing.in_process import DieBefore, InjectedDeath, InProcessLink, InProcessRun
from zocheck_ray.verify import verify_run
from zocheck_ray.workload.adapters import build_trainable
from zocheck_ray.workload.builder import build_task
from zocheck_ray.workload.data import step_seed

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
STEPS, SOFTWARE, HOST = 8, 3, 5


def run_on_cuda(job) -> InProcessRun:
    """`testing.in_process.run_in_process` with the trainers on the GPU."""
    hooks, result = DieBefore([SOFTWARE]), InProcessRun()
    shadow = Shadow(job, hooks=FaultInjection(replay_stalled=True))
    trainer = Trainer(job, InProcessLink(shadow), device="cuda", hooks=hooks)
    try:
        while trainer.step < job.steps:
            try:
                result.absorb(trainer.run(HOST if trainer.step < HOST else job.steps))
            except InjectedDeath:
                result.absorb(trainer.progress())
                trainer.close(hand_over=False)
            else:
                if trainer.step != HOST:
                    continue
                trainer.close(hand_over=False)
                shadow.close()
                shadow = Shadow(job)  # the node lost: rebuilt from durable storage
            trainer = Trainer(job, InProcessLink(shadow), device="cuda", hooks=hooks)
            result.recoveries.append(trainer.recovery)
        result.final_hash = trainer.state_hash()[1]
        trainer.close()
        result.metrics = shadow.drain(job.steps, timeout=120)
        result.shadow = shadow.replica_hash()
        return result
    finally:
        trainer.close()
        shadow.close()


def uninterrupted_on_cuda(job) -> dict[int, str]:
    built = build_trainable(job.model, job.dtype, job.run_seed, job.peft, device="cuda", quantization=job.quantization)
    opt, task = ZOOptimizer(built.parameters, job.zo), build_task(job.task, job.model)
    hashes = {0: state_hash(opt.state_tensors())}
    for t in range(job.steps):
        opt.step(task.closure(built.model, t), seed=step_seed(job.run_seed, t))
        hashes[t + 1] = state_hash(opt.state_tensors())
    return hashes


@pytest.mark.parametrize("cell", ["bnb-nf4-lora", "bnb-nf4-qzo"])
def test_a_cuda_run_through_a_software_and_a_host_failure_is_its_durable_log(tmp_path, llama_dir, corpus, cell):
    pytest.importorskip("bitsandbytes")
    job = job_for(tmp_path, llama_dir, corpus, cell)
    run = run_on_cuda(job)
    assert [r.source for r in run.recoveries] == ["memory", "durable"]
    last = {step: seen[-1] for step, seen in run.step_hashes.items()}  # a step trained again: its second try
    verified = verify_run(job, SimpleNamespace(step_hashes=last, steps=STEPS, final_state_hash=run.final_hash))
    assert verified.verified and not verified.mismatches, verified.audit
    assert run.shadow == (STEPS, run.final_hash)
    expected = uninterrupted_on_cuda(job)
    if any(expected[s] != h for s, h in last.items()):
        pytest.xfail("exact to the durable log, but not the uninterrupted run: this GPU's forward passes are not "
                     "deterministic (the limits in README.md)")
