"""Parameter-efficient ZO through `peft`: LoRA and prefix tuning, trained, replayed and recovered exactly.

Real Hugging Face models wrapped by peft's own classes; the trainer and the shadow in process (no Ray;
tests/integration/test_ray_zo_methods.py takes adapters through Ray's restarts and a host failure):

- the trainable set is the adapter's parameters only, under the names peft saves them with;
- for every optimizer x {LoRA, prefix} x {fp32, bf16}, the trainer's records replay exactly (eager
  oracle and fused kernel) onto the adapter alone;
- a durable snapshot is a peft adapter directory: `PeftModel.from_pretrained(base, snapshot)` gives the
  trainer's logits bit for bit, and the snapshot's size is the adapter's;
- a recovering trainer loads the frozen base (it is not in the image) and takes the adapter from the
  image; one whose base hashes otherwise is refused with an error that says what differs.
"""

import itertools
import json

import pytest
import torch

from support import wait_until
from zocheck_ray.runtime.shadow import Shadow
from zocheck_ray.runtime.trainer import Trainer
from zocheck_ray.control.startup import build_task_once
from zocheck_ray.config import JobConfig, JobConfigError, load_job_config
from zocheck_ray.core import ZOOptimizer, replay, replay_reference, state_hash
from zocheck_ray.storage import SnapshotStore, snapshot_dir
from zocheck_ray.testing.in_process import InProcessLink
from zocheck_ray.testing.reference import uninterrupted_hashes
from zocheck_ray.workload.adapters import BaseModelMismatchError, PeftSettings, build_trainable
from zocheck_ray.workload.models import build_model

OPTIMIZERS = ["zo-sgd", "zo-adam", "sparse-mezo", "zo-sgd-sign", "zo-sgd-mmt", "zo-sgd-cons"]
METHODS = {"lora": PeftSettings(method="lora", r=2, lora_alpha=4), "prefix": PeftSettings(method="prefix",
                                                                                         num_virtual_tokens=3)}
TASK = dict(batch_size=4, max_length=32, eval_size=16, eval_interval=5)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: see conftest


def clone(state):
    return {k: v.detach().clone() for k, v in state.items()}


def test_the_trainable_set_is_the_adapter_under_peft_s_names():
    lora = build_trainable("tiny-opt", "fp32", 0, METHODS["lora"])
    names = [n for n, _ in lora.parameters]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert not any(".default." in n for n in names)  # peft's saved names: no adapter name
    frozen = [p for p in lora.model.parameters() if not p.requires_grad]
    assert sum(p.numel() for _, p in lora.parameters) < sum(p.numel() for p in frozen) / 10
    prefix = build_trainable("tiny-opt", "bf16", 0, METHODS["prefix"])
    ((name, param),) = prefix.parameters
    assert name == "prompt_embeddings" and param.shape[0] == 3
    assert lora.base_hash == build_trainable("tiny-opt", "fp32", 0, METHODS["prefix"]).base_hash
    assert lora.base_hash != build_trainable("tiny-opt", "fp32", 1, METHODS["lora"]).base_hash


@pytest.mark.parametrize("optimizer,method,dtype", list(itertools.product(OPTIMIZERS, METHODS, ["fp32", "bf16"])))
def test_adapter_steps_replay_exactly(optimizer, method, dtype):
    config = dict(optimizer=optimizer, lr=5e-3, eps=1e-2, weight_decay=0.05, sparsity=0.5)
    from zocheck_ray.core import ZOConfig

    zo = ZOConfig(**config)
    built = build_trainable("tiny-opt", dtype, 0, METHODS[method])
    opt = ZOOptimizer(built.parameters, zo)
    initial = clone(opt.state_tensors())
    base = {n: p.detach().clone() for n, p in built.model.named_parameters() if not p.requires_grad}
    gen = torch.Generator().manual_seed(0)
    records = []
    for t in range(4):
        ids = torch.randint(0, 128, (2, 10), generator=gen)
        records.append(opt.step(lambda: built.model(input_ids=ids, labels=ids).loss, seed=40 + t))
    trained = clone(opt.state_tensors())
    assert state_hash(trained) != state_hash(initial)
    for name, p in built.model.named_parameters():  # the base never moves
        if not p.requires_grad:
            assert torch.equal(p, base[name]), name
    assert state_hash(replay(clone(initial), records, zo, start_step=0)) == state_hash(trained)
    assert state_hash(replay_reference(clone(initial), records, zo, start_step=0)) == state_hash(trained)


def peft_job(tmp_path, method="lora", **kw):
    fields = dict(steps=10, storage=str(tmp_path), shadow=dict(snapshot_interval=5),
                  durability=dict(durable_interval=5), hash_every_step=True,
                  zo=dict(optimizer="zo-adam", lr=5e-3, eps=1e-2), peft=METHODS[method].model_dump(), task=TASK)
    fields.update(kw)
    return JobConfig.model_validate(fields)


@pytest.mark.parametrize("method", ["lora", "prefix"])
def test_snapshot_loads_with_peft_and_a_recovery_takes_the_base_from_the_model(tmp_path, method):
    from peft import PeftModel

    job = peft_job(tmp_path, method)
    shadow = Shadow(job)
    trainer = None
    try:
        trainer = Trainer(job, InProcessLink(shadow))
        assert trainer.recovery.source == "fresh"
        progress = trainer.run(10)
        shadow.push(b"", 10)
        shadow.drain(10)
        assert wait_until(lambda: shadow.metrics().durable_step == 10)
        adapter_bytes = sum(t.numel() * t.element_size() for t in trainer.opt.state_tensors().values())
        metrics = shadow.metrics()
        assert metrics.state_bytes == adapter_bytes  # the shadow holds the adapter (and Adam's moments) alone
        assert metrics.peak_held_bytes <= 2 * adapter_bytes + (64 << 20)
        directory = f"{job.run_url}/{snapshot_dir(10)}"

        # PeftModel.from_pretrained on the base gives the trainer's logits bit for bit
        base = build_model(job.model, job.dtype, seed=job.run_seed)
        loaded = PeftModel.from_pretrained(base, directory).eval()
        ids = torch.arange(2, 26).reshape(2, 12)
        with torch.no_grad():
            want = trainer.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            got = loaded(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        assert torch.equal(got, want)
        info = SnapshotStore(job.run_url).get(10)
        # the snapshot names its base: the adapter config by name, the manifest by (model, dtype, run_seed)
        with open(f"{directory}/adapter_config.json") as f:
            assert json.load(f)["base_model_name_or_path"] == job.model
        assert info.manifest.user["base"] == {"model": job.model, "dtype": job.dtype, "run_seed": job.run_seed}
        files = {name: entry.size for name, entry in info.manifest.files.items()}
        assert "adapter_model.safetensors" in files and "adapter_config.json" in files
        assert "model.safetensors" not in files and "config.json" not in files
        assert sum(files.values()) < adapter_bytes * 1.1 + (64 << 10)  # the adapter's size, not the model's
        final = state_hash(trainer.opt.state_tensors())
        trainer.close()
        trainer = None

        # a restarted trainer loads the base and restores the adapter from the shadow's image
        again = Trainer(job, InProcessLink(shadow))
        assert again.recovery.source == "memory" and again.step == 10
        assert state_hash(again.opt.state_tensors()) == final
        with torch.no_grad():
            assert torch.equal(again.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, want)
        again.close()
        expected = uninterrupted_hashes(job)
        assert progress.step_hashes and all(expected[s] == h for s, h in progress.step_hashes.items())
        assert expected[10] == final
    finally:
        if trainer is not None:
            trainer.close()
        shadow.close()


def test_a_recovery_against_another_base_model_is_refused(tmp_path):
    job = peft_job(tmp_path)
    shadow = Shadow(job)
    try:
        trainer = Trainer(job, InProcessLink(shadow))
        trainer.run(3)
        trainer.close()
        # the same adapter, on a base initialised from another seed: other weights
        other = job.model_copy(update={"run_seed": 1})
        with pytest.raises(BaseModelMismatchError, match="SHA-256") as caught:
            Trainer(other, InProcessLink(shadow))
        assert job.run_id in str(caught.value) and "tiny-opt" in str(caught.value)
    finally:
        shadow.close()


def test_a_rebuilt_shadow_keeps_the_run_s_base_and_refuses_another(tmp_path):
    job = peft_job(tmp_path)
    first = Shadow(job)
    try:
        trainer = Trainer(job, InProcessLink(first))
        trainer.run(5)
        first.push(b"", 5)
        first.drain(5)
        trainer.close()
    finally:
        first.close()
    rebuilt = Shadow(job)  # a host failure: the shadow comes back from durable storage
    try:
        assert rebuilt.adapter is not None and rebuilt.replay.source == "durable"
        assert Trainer(job, InProcessLink(rebuilt)).step == 5
        with pytest.raises(BaseModelMismatchError):
            Trainer(job.model_copy(update={"run_seed": 7}), InProcessLink(rebuilt))
    finally:
        rebuilt.close()


def test_bad_peft_settings_are_refused_before_anything_runs():
    with pytest.raises(JobConfigError, match="peft.method"):
        load_job_config(overrides=["peft.method=adalora"])
    with pytest.raises(JobConfigError, match="peft.r"):
        load_job_config(overrides=["peft.method=lora", "peft.r=0"])
    with pytest.raises(JobConfigError, match="target_modules"):
        build_task_once(load_job_config(overrides=["peft.method=lora", "peft.target_modules=[no_such_module]"]))
