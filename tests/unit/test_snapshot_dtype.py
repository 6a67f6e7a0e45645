"""The hand-off to Hugging Face is bit for bit with default arguments: a full snapshot's `config.json` carries
the run's dtype (as `dtype`, which transformers 5 reads, and `torch_dtype`, which 4.x reads), so
`AutoModelForCausalLM.from_pretrained(snapshot)` builds the weights the run trained, whatever the dtype of the
model it started from; `recover --to` writes the same config. An adapter's snapshot loads onto the run's base
with `PeftModel.from_pretrained`."""

from __future__ import annotations

import json

import pytest
import torch

from reference_runs import SMALL_TASK
from zocheck_ray.config import JobConfig
from zocheck_ray.core import state_hash
from zocheck_ray.core.dtypes import JOB_DTYPES
from zocheck_ray.storage import snapshot_dir
from zocheck_ray.testing.in_process import run_in_process
from zocheck_ray.workload.models import trainable_parameters

STEPS = 4
NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@pytest.fixture(scope="module")
def float32_directory(tmp_path_factory):
    """A model directory saved in float32 (its config.json says so), without a tokenizer."""
    from zocheck_ray.workload import build_model

    directory = tmp_path_factory.mktemp("opt-float32")
    build_model("tiny-opt").save_pretrained(directory)
    assert json.loads((directory / "config.json").read_text())["dtype"] == "float32"
    return directory


def run_of(tmp_path, model: str, dtype: str, **fields) -> tuple[JobConfig, str, str]:
    """`model` trained `STEPS` steps in `dtype` (trainer and shadow in this process): (job, final state_hash,
    the final snapshot's directory)."""
    job = JobConfig.model_validate({
        "model": model, "dtype": dtype, "steps": STEPS, "storage": str(tmp_path / "runs"), "log_interval": STEPS,
        "shadow": {"snapshot_interval": STEPS}, "durability": {"durable_interval": STEPS},
        "zo": {"lr": 2e-3, "eps": 1e-2 if dtype != "fp32" else 1e-3},
        "task": {**SMALL_TASK, "tokenizer": "byte"}, **fields})
    run = run_in_process(job)
    assert run.metrics.durable_step == STEPS
    return job, run.final_hash, f"{job.run_url}/{snapshot_dir(STEPS)}"


def loaded_hash(directory) -> str:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)  # default arguments
    return state_hash({name: p.detach() for name, p in trainable_parameters(model)})


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("source", ["built-in", "float32 directory"])
def test_from_pretrained_of_a_snapshot_gives_the_runs_weights(tmp_path, float32_directory, dtype, source):
    model = "tiny-opt" if source == "built-in" else str(float32_directory)
    job, final, snapshot = run_of(tmp_path, model, dtype)
    config = json.loads(open(f"{snapshot}/config.json").read())
    assert (config["dtype"], config["torch_dtype"]) == (NAMES[dtype], NAMES[dtype])
    assert loaded_hash(snapshot) == final


def test_recover_to_writes_the_snapshots_config_and_loads_bit_for_bit(tmp_path, float32_directory):
    from zocheck_ray.cli import main

    job, final, snapshot = run_of(tmp_path, str(float32_directory), "bf16")
    recovered = tmp_path / "recovered"
    assert main(["recover", "--storage", job.run_url, "--to", str(recovered)]) == 0
    assert json.loads((recovered / "config.json").read_text()) == json.loads(open(f"{snapshot}/config.json").read())
    assert loaded_hash(recovered) == final


def test_an_adapters_snapshot_loads_onto_the_runs_base_with_peft(tmp_path, float32_directory):
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from zocheck_ray.storage import SnapshotStore

    job, final, snapshot = run_of(tmp_path, str(float32_directory), "bf16", peft={"method": "lora", "r": 4})
    base = AutoModelForCausalLM.from_pretrained(float32_directory, dtype=JOB_DTYPES["bf16"], local_files_only=True)
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(base, snapshot))
    order = [t.name for t in SnapshotStore(job.run_url, create=False).get(STEPS).manifest.tensors]
    assert state_hash({name: loaded[name] for name in order}) == final


def test_a_shadow_given_no_config_writes_the_runs_dtype_too(tmp_path, float32_directory):
    from support import trained
    from zocheck_ray.runtime.shadow import Shadow

    job = JobConfig(model=str(float32_directory), dtype="bf16", storage=str(tmp_path / "runs"),
                    shadow={"snapshot_interval": 2}, task={"tokenizer": "byte"})
    initial, opt, records = trained(job, 2)
    shadow = Shadow(job)
    try:
        shadow.initialize(0, initial)  # no model_config: the shadow's own
        shadow.push(b"".join(r.to_bytes() for r in records))
        assert shadow.drain(2, timeout=120).durable_step == 2
    finally:
        shadow.close()
    snapshot = f"{job.run_url}/{snapshot_dir(2)}"
    assert json.loads(open(f"{snapshot}/config.json").read())["dtype"] == "bfloat16"
    assert loaded_hash(snapshot) == state_hash(opt.state_tensors())
