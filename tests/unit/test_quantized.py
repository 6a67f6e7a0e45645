"""A quantized frozen base (bitsandbytes, optimum-quanto, torchao) under a ZO-trained LoRA, or its scales (QZO),
recovered bit for bit.

Real backends through `from_pretrained(quantization_config=...)` on a small Llama saved by the test; the trainer
and the shadow in process (`testing.in_process`):

- each cell goes through a software failure and a host failure and ends with the uninterrupted run's state hash
  at every step, verified against the durable log; the shadow holds the trained state alone (2x at its peak);
- a snapshot holds the trained state and the base's identity: a LoRA snapshot loads over the same quantized base
  with `PeftModel.from_pretrained`, a QZO snapshot with `load_qzo`, each to the run's state hash;
- the base's identity is the SHA-256 of its quantized tensors and config: the same on every load, another for
  other bits, and a recovery, resume or QZO load onto another base is refused naming both.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from zocheck_ray.config import JobConfig, JobConfigError, load_job_config
from zocheck_ray.core import state_hash
from zocheck_ray.runtime.injection import FaultInjection
from zocheck_ray.storage import SnapshotStore, snapshot_dir
from zocheck_ray.testing.in_process import run_in_process
from zocheck_ray.testing.reference import uninterrupted_hashes
from zocheck_ray.workload.errors import WorkloadError
from zocheck_ray.workload.quantized import BACKENDS, QuantizationSettings

STEPS, SOFTWARE, HOST = 8, [3], 5
LORA = {"method": "lora", "r": 2, "lora_alpha": 4}
CELLS = {
    "bnb-nf4-lora": ({"backend": "bitsandbytes", "bits": 4}, LORA),
    "quanto-int4-lora": ({"backend": "quanto", "bits": 4}, LORA),
    "bnb-int8-lora": ({"backend": "bitsandbytes", "bits": 8}, LORA),
    "bnb-nf4-qzo": ({"backend": "bitsandbytes", "bits": 4}, {"method": "qzo"}),
}
"""The exactness targets: 4-bit bases (bitsandbytes nf4, an int4), an 8-bit base, QZO on a 4-bit base. torchao is not
in the test extra (importing it costs every `import transformers` seconds): docs/quantized.md."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small models: see conftest


def needs(backend: str) -> None:
    """The test extra installs bitsandbytes and optimum-quanto: a missing one fails, naming it."""
    __import__(BACKENDS[backend][0])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A small Llama saved with save_pretrained: rows of 128 weights, so every backend's groups fit."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    directory = tmp_path_factory.mktemp("models") / "llama"
    model.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"row {i} of a small corpus"}) for i in range(8)) + "\n")
    return str(path)


def job_for(storage, model, corpus, cell: str, **changes) -> JobConfig:
    quantization, peft = CELLS[cell]
    qzo = peft["method"] == "qzo"
    fields = dict(
        model=model, quantization=quantization, peft=peft, steps=STEPS, storage=str(storage), run_id=cell,
        shadow=dict(snapshot_interval=2, max_lag_steps=1000), durability=dict(durable_interval=4), log_interval=4,
        hash_every_step=True, zo=dict(lr=1e-4, eps=1e-3, grad_clip=100.0) if qzo else dict(lr=5e-3, eps=1e-2),
        task=dict(kind="lm", data_path=corpus, text_field="text", tokenizer="byte", batch_size=2, max_length=16,
                  eval_size=1, eval_interval=1000))
    fields.update(changes)
    return JobConfig.model_validate(fields)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, llama_dir, corpus):
    """Each cell's run through a software failure and a host failure, run once for the module's tests."""
    done = {}

    def run(cell: str):
        if cell not in done:
            needs(CELLS[cell][0]["backend"])
            job = job_for(tmp_path_factory.mktemp(cell), llama_dir, corpus, cell)
            done[cell] = job, run_in_process(job, software=SOFTWARE, host=[HOST],
                                             first_shadow_hooks=FaultInjection(replay_stalled=True))
        return done[cell]

    return run


def settings(cell: str) -> QuantizationSettings:
    return QuantizationSettings.model_validate(CELLS[cell][0])


@pytest.mark.parametrize("cell", list(CELLS))
def test_a_software_and_a_host_failure_end_exact_and_verified_against_the_durable_log(finished, cell):
    from zocheck_ray.verify import verify_run

    job, run = finished(cell)
    expected = uninterrupted_hashes(job)
    assert expected[STEPS] != expected[0]  # it trained
    assert sorted(run.step_hashes) == list(range(1, STEPS + 1))
    for step, seen in run.step_hashes.items():
        assert set(seen) == {expected[step]}, f"the state after step {step} differs"
    assert [r.source for r in run.recoveries] == ["memory", "durable"]
    assert all(r.state_hash == expected[r.step] for r in run.recoveries)
    assert run.final_hash == expected[STEPS] and run.shadow == (STEPS, expected[STEPS])
    summary = SimpleNamespace(step_hashes={s: h[0] for s, h in run.step_hashes.items()}, steps=STEPS,
                              final_state_hash=run.final_hash)
    verified = verify_run(job, summary)
    assert verified.verified and not verified.mismatches, verified.audit
    # the shadow holds the trained state alone: the replica and one image at its peak
    assert run.metrics.peak_held_bytes <= 2.1 * run.metrics.state_bytes


def test_a_lora_snapshot_holds_the_adapter_and_the_base_s_identity_and_loads_with_peft(finished):
    from peft import PeftModel

    from zocheck_ray.workload.adapters import adapter_parameters
    from zocheck_ray.workload.quantized.load import load_quantized, quantized_identity

    job, run = finished("bnb-nf4-lora")
    directory = f"{job.run_url}/{snapshot_dir(STEPS)}"
    info = SnapshotStore(job.run_url).get(STEPS)
    assert set(info.manifest.files) == {"adapter_model.safetensors", "adapter_config.json"}
    assert sum(entry.size for entry in info.manifest.files.values()) < run.metrics.state_bytes + (16 << 10)
    base = load_quantized(job.model, settings("bnb-nf4-lora"), job.dtype)
    assert info.manifest.user["adapter"]["base_hash"] == quantized_identity(base, settings("bnb-nf4-lora"), "fp32")
    loaded = PeftModel.from_pretrained(base, directory, is_trainable=True).eval()
    assert state_hash(dict(adapter_parameters(loaded))) == run.final_hash


def test_a_qzo_snapshot_holds_the_scales_and_the_base_s_identity_and_loads_with_load_qzo(finished):
    from zocheck_ray.workload.quantized.load import load_quantized, quantized_identity
    from zocheck_ray.workload.quantized.snapshot import load_qzo

    job, run = finished("bnb-nf4-qzo")
    directory = f"{job.run_url}/{snapshot_dir(STEPS)}"
    info = SnapshotStore(job.run_url).get(STEPS)
    assert set(info.manifest.files) == {"adapter_model.safetensors", "adapter_config.json"}
    base = load_quantized(job.model, settings("bnb-nf4-qzo"), job.dtype)
    identity = quantized_identity(base, settings("bnb-nf4-qzo"), "fp32")
    config = json.loads(open(f"{directory}/adapter_config.json").read())
    assert config["peft_type"] == "QZO" and config["base_identity"] == identity
    assert info.manifest.user["adapter"]["base_hash"] == identity
    state = load_qzo(base, directory)
    assert list(state) == [n for n in state if n.endswith(".weight.absmax")]
    assert state_hash(state) == run.final_hash  # the live scales of the base: its forward is the trained model's
    assert sum(t.numel() * t.element_size() for t in state.values()) == run.metrics.state_bytes


def test_a_qzo_snapshot_offered_to_another_base_is_refused_naming_both(finished):
    from zocheck_ray.workload.adapters import BaseModelMismatchError
    from zocheck_ray.workload.quantized.load import load_quantized
    from zocheck_ray.workload.quantized.snapshot import load_qzo

    job, _ = finished("bnb-nf4-qzo")
    fp4 = QuantizationSettings(backend="bitsandbytes", bits=4, quant_type="fp4")
    other = load_quantized(job.model, fp4, job.dtype)
    with pytest.raises(BaseModelMismatchError, match="SHA-256") as caught:
        load_qzo(other, f"{job.run_url}/{snapshot_dir(STEPS)}")
    recorded = SnapshotStore(job.run_url).get(STEPS).manifest.user["adapter"]["base_hash"]
    assert recorded in str(caught.value)


def test_the_base_s_identity_is_its_quantized_bits_and_config(llama_dir):
    needs("bitsandbytes")
    from zocheck_ray.workload.quantized.load import load_quantized, quantized_identity, quantized_layers

    nf4 = settings("bnb-nf4-lora")
    first, second = load_quantized(llama_dir, nf4), load_quantized(llama_dir, nf4)
    assert quantized_identity(first, nf4, "fp32") == quantized_identity(second, nf4, "fp32")  # every load
    assert quantized_identity(first, nf4, "fp32") != quantized_identity(first, nf4, "bf16")
    fp4 = QuantizationSettings(backend="bitsandbytes", bits=4, quant_type="fp4")
    assert quantized_identity(load_quantized(llama_dir, fp4), fp4, "fp32") != quantized_identity(first, nf4, "fp32")
    _, _, scale = quantized_layers(second)[0]
    with torch.no_grad():
        scale[0] += 1e-3  # the scales at load are part of it
    assert quantized_identity(second, nf4, "fp32") != quantized_identity(first, nf4, "fp32")


def test_a_recovery_onto_another_base_is_refused_naming_both(tmp_path, llama_dir, corpus):
    needs("bitsandbytes")
    from zocheck_ray.runtime.shadow import Shadow
    from zocheck_ray.runtime.trainer import Trainer
    from zocheck_ray.testing.in_process import InProcessLink
    from zocheck_ray.workload.adapters import BaseModelMismatchError

    job = job_for(tmp_path, llama_dir, corpus, "bnb-nf4-lora")
    shadow = Shadow(job)
    try:
        trainer = Trainer(job, InProcessLink(shadow))
        mine = trainer.adapter.base_hash
        trainer.run(2)
        trainer.close()
        other = job.model_copy(update={"quantization": QuantizationSettings(backend="bitsandbytes", quant_type="fp4")})
        with pytest.raises(BaseModelMismatchError) as caught:
            Trainer(other, InProcessLink(shadow))
        assert mine in str(caught.value) and "bitsandbytes 4-bit fp4" in str(caught.value)
    finally:
        shadow.close()


def test_a_resume_with_another_quantization_is_refused_before_anything_starts(tmp_path, llama_dir, corpus):
    from zocheck_ray.control.identity import check_identity

    job = job_for(tmp_path, llama_dir, corpus, "bnb-nf4-lora")
    task = SimpleNamespace(fingerprint="rows")
    check_identity(job, task, None, print).record()
    other = job.model_copy(update={"quantization": QuantizationSettings(backend="quanto", bits=8)})
    with pytest.raises(JobConfigError, match="quantization.backend='bitsandbytes'.*quantization.backend='quanto'"):
        check_identity(other, task, 4, print)


def test_qzo_clips_the_projected_gradient_as_qzo_does_and_the_record_carries_it(llama_dir):
    needs("bitsandbytes")
    from zocheck_ray.core import ZOConfig, ZOOptimizer, replay
    from zocheck_ray.workload.adapters import build_trainable
    from zocheck_ray.workload.peft_settings import PeftSettings

    built = build_trainable(llama_dir, "fp32", 0, PeftSettings(method="qzo"), quantization=settings("bnb-nf4-qzo"))
    assert [n for n, _ in built.parameters] == [f"{m}.weight.absmax" for m, _ in built.model.named_modules()
                                                if m.endswith("_proj")]
    zo = ZOConfig(lr=1e-6, eps=1e-3, grad_clip=1e-3)
    opt = ZOOptimizer(built.parameters, zo)
    start = {n: t.clone() for n, t in opt.state_tensors().items()}
    ids = torch.arange(24).reshape(2, 12)
    records = [opt.step(lambda: built.model(input_ids=ids, labels=ids).loss, seed=s) for s in (1, 2, 3)]
    assert all(abs(r.projected_grad) <= 1e-3 for r in records)
    assert any(abs(r.projected_grad) == 1e-3 for r in records)
    assert state_hash(replay(start, records, zo, start_step=0)) == state_hash(opt.state_tensors())


def test_the_start_up_check_loads_twice_on_the_device_and_refuses_what_cannot_run(llama_dir):
    needs("bitsandbytes")
    from zocheck_ray.workload.quantized.probe import check_quantized

    check_quantized(llama_dir, settings("bnb-nf4-qzo"), "bf16", 0, True, "cpu")  # the same bits twice
    if not torch.cuda.is_available():
        with pytest.raises(WorkloadError, match="bitsandbytes 4-bit nf4 with dtype fp32 cannot run on cuda"):
            check_quantized(llama_dir, settings("bnb-nf4-qzo"), "fp32", 0, True, "cuda")


def test_bad_quantization_input_gets_one_line_before_any_actor_starts(llama_dir, monkeypatch):
    from zocheck_ray.control.startup import build_task_once
    from zocheck_ray.workload.quantized.qzo import qzo_scales

    def refused(match, *overrides):
        with pytest.raises(JobConfigError, match=match) as caught:
            build_task_once(load_job_config(overrides=[f"model={llama_dir}", *overrides]))
        assert "\n" not in str(caught.value)

    refused("full fine-tuning|without peft every weight", "quantization.backend=bitsandbytes")
    refused("peft.method=qzo trains the scales of a quantized base", "peft.method=qzo")
    refused("not a model directory", "model=tiny-llama", "quantization.backend=quanto", "peft.method=lora")
    refused("zo.weight_decay", "quantization.backend=bitsandbytes", "peft.method=qzo", "zo.weight_decay=0.1")
    refused("double_quant", "quantization.backend=bitsandbytes", "peft.method=qzo", "quantization.double_quant=true")
    refused("quantization.group_size is a torchao setting", "quantization.backend=quanto", "quantization.group_size=8",
            "peft.method=lora")
    monkeypatch.setitem(BACKENDS, "quanto", ("zocheck_no_such_module", "optimum-quanto", "quanto"))
    refused(r"pip install 'zocheck-ray\[quanto\]'", "quantization.backend=quanto", "peft.method=lora")
    with pytest.raises(WorkloadError, match="has none"):  # QZO on a base without quantized layers
        qzo_scales(torch.nn.Sequential(torch.nn.Linear(4, 4)), settings("bnb-nf4-qzo"))
