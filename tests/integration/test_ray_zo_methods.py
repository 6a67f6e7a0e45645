"""The ZO methods beyond MeZO recover exactly on a real Ray instance: ZO-Bench's optimizers, several
perturbations per step, gradient accumulation.

Each run loses its trainer three times (software failures: Ray restarts the process, which restores
from the shadow's image plus records) and then both processes (a host failure: the shadow rebuilds from
durable storage); every step's `state_hash` must equal the uninterrupted plain loop's. The replay
matrix itself (every optimizer x dtype x q, trainer against the eager oracle, the fused kernel and the
Triton kernels) is proven without Ray in tests/unit/test_zo_methods.py and test_triton_kernels.py.
"""

import pytest

from reference_runs import SMALL_TASK, assert_exact, job_for, uninterrupted_hashes
from zocheck_ray.testing import FailAt
from zocheck_ray.testing import run_with_faults as run

pytestmark = pytest.mark.usefixtures("local_ray")

SOFTWARE = [5, 17, 30]
HOST = 23


def run_with_every_failure(job):
    """Three software failures, then a host failure (both processes and the shadow's images lost)."""
    return run(job, fail_at=SOFTWARE, progress=None, callbacks=[FailAt([HOST], "host")])


@pytest.mark.parametrize("optimizer,dtype,zo,peft", [
    ("zo-sgd-sign", "fp32", {}, None),
    ("zo-sgd-mmt", "bf16", {"num_perturbations": 2}, {"method": "lora", "r": 4}),
    ("zo-sgd-cons", "bf16", {}, {"method": "prefix", "num_virtual_tokens": 4}),
    ("zo-adam", "fp32", {}, {"method": "lora", "r": 2, "target_modules": ["q_proj", "k_proj", "fc1"]}),
])
def test_three_software_failures_and_a_host_failure_recover_exactly(tmp_path, optimizer, dtype, zo, peft):
    """A restarted trainer (and, after the host failure, a rebuilt shadow) with an adapter: the trainer loads
    the frozen base itself and takes the adapter from the image."""
    job = job_for(tmp_path, optimizer, dtype, peft=peft)
    job = job.model_copy(update={"zo": job.zo.model_copy(update=zo)})
    summary = run_with_every_failure(job)
    assert sorted(r.failed_at_step for r in summary.recoveries) == sorted([*SOFTWARE, HOST])
    assert {r.mode for r in summary.recoveries} == {"software", "host"}
    host = next(r for r in summary.recoveries if r.mode == "host")
    assert host.image_source == "durable"
    assert_exact(summary, uninterrupted_hashes(job))


def test_gradient_accumulation_recovers_exactly(tmp_path):
    job = job_for(tmp_path, "zo-sgd", "fp32", task={**SMALL_TASK, "micro_batch_size": 3})
    summary = run(job, fail_at=[9, 26], progress=None)
    assert [r.failed_at_step for r in summary.recoveries] == [9, 26]
    assert_exact(summary, uninterrupted_hashes(job))
