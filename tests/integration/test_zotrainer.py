"""Fine-tuning on your own data as Hugging Face users do, on a real local Ray: chat SFT from a job file, and
`ZOTrainer` with a `datasets.Dataset`, your own collator, loss and `model_init`. Each run takes a software and a
host failure and must end equal, at every step, to the uninterrupted run, verified against the durable log."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from reference_runs import assert_exact
from zocheck_ray.config import load_job_config
from zocheck_ray.control import FaultPlan, RunFailedError, run
from zocheck_ray.control.startup import build_task_once
from zocheck_ray.testing.reference import uninterrupted_hashes
from zocheck_ray.verify import verify_run
from zocheck_ray.zotrainer import ZOTrainer, ZOTrainerCallback

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]

REPO = Path(__file__).resolve().parents[2]
STEPS = 20
FAILURES = ((7, "software"), (13, "host"))
"""A trainer process lost before step 7, then the trainer and the shadow with their images at step 13."""
SMALL = {"steps": STEPS, "hash_every_step": True, "log_interval": 4, "shadow": {"snapshot_interval": 4}}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A small Llama with a chat template, saved as a user's model directory (`save_pretrained`)."""
    from zocheck_ray.workload import build_model
    from zocheck_ray.workload.tokenization import chat_tokenizer

    directory = tmp_path_factory.mktemp("chat-model")
    build_model("tiny-chat", seed=3).save_pretrained(directory)
    chat_tokenizer().save_pretrained(directory)
    return directory


def test_a_chat_sft_job_with_lora_recovers_from_a_software_and_a_host_failure_exactly(chat_model, tmp_path):
    job = load_job_config(REPO / "deploy" / "examples" / "sft-chat-lora.yaml", overrides=[
        f"model={chat_model}", f"storage={tmp_path}", "task.batch_size=4", "task.eval_size=4", "task.eval_interval=8",
        "task.max_length=160"], **{k: v for k, v in SMALL.items() if k != "shadow"}, **{"shadow.snapshot_interval": 4})
    summary = run(job, progress=None, faults=FaultPlan(schedule=FAILURES))
    assert [(r.failed_at_step, r.mode) for r in summary.recoveries] == [(7, "software"), (13, "host")]
    assert summary.recoveries[1].image_source == "durable"
    assert_exact(summary, uninterrupted_hashes(job), STEPS)
    assert verify_run(job, summary).verified
    assert summary.task["format"] == "conversational_language_modeling"
    # held-out loss and perplexity over the assistants' tokens, and greedy generations from held-out prompts
    assert {0, 8, 16, STEPS} <= set(summary.evaluations) and "perplexity" in summary.evaluations[STEPS]
    assert set(summary.samples) == set(summary.evaluations) and len(summary.samples[STEPS]) == 3
    prompt, _ = summary.samples[STEPS][0]
    assert prompt.endswith("<|im_start|>assistant\n")


def features(n: int, vocab: int = 256) -> list[dict]:
    """Rows already tokenized: the model's inputs, with labels (-100 where nothing is trained)."""
    rows = []
    for i in range(n):
        ids = [1, *(2 + (7 * i + 3 * j) % (vocab - 2) for j in range(6 + i % 5))]
        rows.append({"input_ids": ids, "labels": [-100, -100, *ids[2:]], "row": i})
    return rows


def user_code():
    """A user's collator, loss and `model_init`, defined where Ray pickles them by value (as in a user's script:
    a test module is not importable in Ray's workers)."""

    def pad_to_eight(rows: list[dict]) -> dict:
        """Right-pads to a multiple of 8, drops the `row` column."""
        width = -(-max(len(r["input_ids"]) for r in rows) // 8) * 8
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
            labels[i, :len(r["labels"])] = torch.tensor(r["labels"])
        return {"input_ids": ids, "attention_mask": (labels != -100) | (ids != 0), "labels": labels}

    def token_loss(outputs, labels, num_items_in_batch=None):
        """`transformers.Trainer`'s `compute_loss_func` signature: the trained tokens' summed cross-entropy over
        `num_items_in_batch`."""
        logits = outputs.logits[:, :-1].float()
        total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                                  ignore_index=-100, reduction="sum")
        return total / num_items_in_batch

    def small_llama():
        """A Llama built from its config (its weights seeded as `Trainer` seeds them)."""
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64))

    return pad_to_eight, token_loss, small_llama


class Events(ZOTrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step(self, event):
        self.seen.append(("step", event.step))

    def on_snapshot(self, event):
        self.seen.append(("durable" if event.durable else "snapshot", event.step))

    def on_evaluate(self, event):
        self.seen.append(("evaluate", event.step))
        with pytest.raises(TypeError):
            event.metrics["loss"] = 0.0  # read-only: a callback watches the run
        self.metrics = event.metrics

    def on_recovery(self, event):
        self.seen.append(("recovery", event.failed_at_step, event.mode))


def test_a_zotrainer_run_with_your_collator_loss_and_model_init_recovers_exactly(tmp_path):
    from datasets import Dataset

    pad_to_eight, token_loss, small_llama = user_code()
    events = Events()
    trainer = ZOTrainer(model=small_llama, args={**SMALL, "storage": str(tmp_path), "zo": {"lr": 1e-3, "eps": 1e-3},
                                                 "task": {"batch_size": 4, "eval_size": 6, "eval_interval": 8}},
                        train_dataset=Dataset.from_list(features(40)), data_collator=pad_to_eight,
                        compute_loss_func=token_loss, callbacks=[events])
    summary = trainer.train(progress=None, faults=FaultPlan(schedule=FAILURES))
    job = trainer.args
    assert job.model.startswith("model_init:") and job.model.endswith("small_llama")
    assert_exact(summary, uninterrupted_hashes(job, build_task_once(job, trainer.workload)), STEPS)
    assert verify_run(job, summary).verified
    assert [e for e in events.seen if e[0] == "recovery"] == [("recovery", 7, "software"), ("recovery", 13, "host")]
    steps = [e[1] for e in events.seen if e[0] == "step"]
    assert steps == sorted(steps) and steps[-1] == STEPS
    assert [e[1] for e in events.seen if e[0] == "evaluate"] == sorted(summary.evaluations)
    assert ("durable", STEPS) in events.seen and isinstance(events.metrics, types.MappingProxyType)
    assert trainer.evaluate() == {"eval_loss": summary.evaluations[STEPS]["loss"],
                                  "eval_perplexity": summary.evaluations[STEPS]["perplexity"], "step": STEPS}
    out = trainer.save_model(tmp_path / "out")
    from transformers import AutoModelForCausalLM

    from zocheck_ray.core import state_hash

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert state_hash({n: p.detach() for n, p in loaded.named_parameters()}) == summary.final_state_hash
    assert json.loads((out / "recovery.json").read_text())["step"] == STEPS


def test_a_loss_that_is_not_a_scalar_ends_the_run_in_one_line_naming_the_function(tmp_path):
    pad_to_eight, _, _ = user_code()

    def per_token(outputs, labels, num_items_in_batch=None):
        return outputs.logits.float().mean(-1)

    trainer = ZOTrainer(model="tiny-llama", args={"steps": 8, "storage": str(tmp_path), "shadow": {"snapshot_interval": 4},
                                                  "task": {"batch_size": 4, "eval_size": 4}},
                        train_dataset=features(20, vocab=128), data_collator=pad_to_eight, compute_loss_func=per_token)
    with pytest.raises(RunFailedError) as failed:
        trainer.train(progress=None)
    line = str(failed.value)
    assert "\n" not in line and "test_a_loss_that_is_not_a_scalar_ends_the_run_in_one_line_naming_the_function.<locals>.per_token" in line
    assert "returned a loss of shape [4, " in line and "it must return one scalar tensor" in line


def test_a_zotrainer_runs_inside_a_ray_tune_trainable(tmp_path):
    from ray import tune

    from zocheck_ray.tune import trial_resources

    def chat_trainable(config: dict) -> None:
        """A user's Ray Tune trainable: a `ZOTrainer` built from the trial's config, trained."""
        from datasets import Dataset

        from zocheck_ray import ZOTrainer

        chats = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                               {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(24)]
        ZOTrainer(model="tiny-chat", args=config["args"] | {"zo": {"lr": config["lr"], "eps": 1e-3}},
                  train_dataset=Dataset.from_list(chats)).train(progress=None)

    args = {"run_id": "tuned", "steps": 8, "storage": str(tmp_path / "runs"), "shadow": {"snapshot_interval": 4},
            "log_interval": 4, "task": {"kind": "sft", "batch_size": 4, "eval_size": 4, "eval_interval": 4}}
    tuner = tune.Tuner(tune.with_resources(chat_trainable, trial_resources(load_job_config(base=args))),
                       param_space={"lr": 1e-3, "args": args},
                       run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), name="zotrainer"))
    (result,) = list(tuner.fit())
    assert result.error is None
    assert result.metrics["step"] == 8 and result.metrics["exact"] is True
    assert result.metrics["eval_loss"] > 0 and result.metrics["run_id"].startswith("tuned-")
    assert result.checkpoint is not None  # a pointer to the trial's newest durable image


def test_the_zotrainer_example_in_docs_sft_md_runs(tmp_path, monkeypatch):
    import re

    monkeypatch.chdir(tmp_path)  # its ./runs and ./out
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "sft.md").read_text(), re.S)
    (code,) = [block for block in blocks if "ZOTrainer(" in block]
    scope: dict = {}
    exec(compile(code, "docs/sft.md", "exec"), scope)
    summary, trainer = scope["summary"], scope["trainer"]
    assert summary.steps == 20 and summary.final_state_hash == summary.shadow_state_hash
    assert trainer.evaluate()["step"] == 20 and "eval_perplexity" in trainer.evaluate()
    from peft import PeftModel

    from zocheck_ray.core import state_hash
    from zocheck_ray.workload import build_model
    from zocheck_ray.workload.adapters import adapter_parameters

    adapter = PeftModel.from_pretrained(build_model("tiny-chat"), tmp_path / "out", is_trainable=True)
    loaded = {key: p.detach() for key, p in adapter_parameters(adapter)}
    assert state_hash(loaded) == summary.final_state_hash  # the adapter saved is the run's final state, bit for bit


def test_the_readme_s_trl_and_zotrainer_examples_run_and_differ_in_ten_lines(tmp_path, monkeypatch):
    """The README's two blocks, each as written, on a model directory saved here as `my-model` and the shipped
    chats as `chats.jsonl`: TRL's (first order, without Ray) and ours; both write an adapter to ./out."""
    import difflib
    import re
    import shutil

    from zocheck_ray.workload import build_model
    from zocheck_ray.workload.datafiles import SHIPPED_CHATS
    from zocheck_ray.workload.tokenization import chat_tokenizer

    monkeypatch.chdir(tmp_path)
    build_model("tiny-chat", seed=3).save_pretrained("my-model")
    chat_tokenizer().save_pretrained("my-model")
    shutil.copy(SHIPPED_CHATS, "chats.jsonl")
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Your own data"):text.index("## Limits")]
    trl, ours = re.findall(r"```python\n(.*?)```", section, re.S)
    changed = [line for line in difflib.unified_diff(trl.splitlines(), ours.splitlines(), lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert len([line for line in changed if line.startswith("+")]) <= 10, changed
    exec(compile(trl, "README.md (TRL)", "exec"), {})
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()
    shutil.rmtree(tmp_path / "out")
    scope: dict = {}
    exec(compile(ours, "README.md (zocheck-ray)", "exec"), scope)
    summary = scope["trainer"].summary
    assert summary.steps == 20 and summary.final_state_hash == summary.shadow_state_hash
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["target_modules"]


def test_a_model_init_that_builds_another_architecture_after_a_restart_ends_the_run_in_one_line(tmp_path):
    calls = tmp_path / "calls"

    def changes_after_two_calls():
        """ZOTrainer's call and the first trainer's build give 2 layers; the restarted trainer's, 3."""
        from transformers import LlamaConfig, LlamaForCausalLM

        n = int(calls.read_text()) if calls.exists() else 0
        calls.write_text(str(n + 1))
        return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=2 if n < 2 else 3, num_attention_heads=2,
                                            num_key_value_heads=1, max_position_embeddings=32))

    pad_to_eight, _, _ = user_code()
    trainer = ZOTrainer(model=changes_after_two_calls, train_dataset=features(16, vocab=128), data_collator=pad_to_eight,
                        args={"steps": 8, "storage": str(tmp_path), "shadow": {"snapshot_interval": 4},
                              "task": {"batch_size": 4, "eval_size": 4}})
    with pytest.raises(RunFailedError) as failed:
        trainer.train(progress=None, faults=FaultPlan(steps=(3,)))
    line = str(failed.value)
    assert "\n" not in line and "failed at step 3: rank 0: model_init " in line
    assert "changes_after_two_calls returned LlamaForCausalLM with parameter layout " in line
    assert "it must build the same architecture each time" in line and calls.read_text() == "3"
