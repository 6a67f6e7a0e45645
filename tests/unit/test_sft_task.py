"""`SFTTask` and `tiny-chat`: the batch of step t is a pure function of (data_seed, t); the loss is the model's own
over the trained tokens; evaluation gives token-weighted held-out loss and perplexity and deterministic greedy
generations that stop at EOS or the end of a turn; tiny-chat's tokenizer is a real Hugging Face tokenizer whose
snapshot files load back as the same tokenizer."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
import torch.nn.functional as F

from zocheck_ray.workload import TaskConfig, build_model, build_task
from zocheck_ray.workload.data import batch_indices
from zocheck_ray.workload.tasks import IGNORE
from zocheck_ray.workload.tokenization import (
    CHAT_TEMPLATE, ByteTokenizer, HFTokenizer, byte_tokenizer_files, chat_tokenizer, load_tokenizer,
    snapshot_tokenizer_files,
)

EOS, IM_END = 258, 260


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


CHATS = [{"messages": [turn("user", f"Question {i}?"), turn("assistant", f"Answer {i}."),
                       turn("user", f"And {i + 1}?"), turn("assistant", f"Then {i + 1}.")]} for i in range(12)]
PAIRS = [{"prompt": f"Count to {i}:", "completion": " " + " ".join(map(str, range(i)))} for i in range(1, 13)]


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-chat", seed=1)


@pytest.fixture(scope="module")
def chat_task():
    return build_task(TaskConfig(kind="sft", batch_size=4, eval_size=4, data_seed=7, assistant_only_loss=True),
                      "tiny-chat", rows=CHATS)


def test_the_batch_of_step_t_is_a_pure_function_of_the_data_seed_and_t(chat_task):
    again = build_task(chat_task.config, "tiny-chat", rows=CHATS)
    for step in range(4):
        a, b = chat_task.batch(step), again.batch(step)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        for r, i in enumerate(batch_indices(7, step, 4, chat_task.n_train)):
            ex = chat_task.train_examples[i]
            n = len(ex.input_ids)
            assert a["input_ids"][r, :n].tolist() == ex.input_ids and int(a["attention_mask"][r].sum()) == n
            assert bool((a["input_ids"][r, n:] == chat_task.tokenizer.pad_id).all())  # right-padded, as TRL
            trained = [ex.input_ids[t + 1] if ex.loss_mask[t + 1] else IGNORE for t in range(n - 1)]
            assert a["targets"][r, :n - 1].tolist() == trained and bool((a["targets"][r, n - 1:] == IGNORE).all())
    other = build_task(chat_task.config.model_copy(update={"data_seed": 8}), "tiny-chat", rows=CHATS)
    assert not torch.equal(other.batch(0)["input_ids"], chat_task.batch(0)["input_ids"])


def reference_nll(model, examples) -> tuple[float, int]:
    """Summed cross-entropy of each example's trained tokens, one example at a time, and their count."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            logits = model(input_ids=torch.tensor([ex.input_ids])).logits[0, :-1].float()
            picked = torch.tensor(ex.loss_mask[1:]) == 1
            total += float(F.cross_entropy(logits[picked], torch.tensor(ex.input_ids[1:])[picked], reduction="sum"))
            count += int(picked.sum())
    return total, count


def test_the_loss_is_the_mean_cross_entropy_of_the_trained_tokens(chat_task, model):
    batch = chat_task.batch(0)
    rows = [chat_task.train_examples[i] for i in batch_indices(7, 0, 4, chat_task.n_train)]
    total, count = reference_nll(model, rows)
    assert count == int((batch["targets"] != IGNORE).sum())
    with torch.no_grad():
        loss = float(chat_task.loss(model, batch))
    assert math.isclose(loss, total / count, rel_tol=1e-6)
    labels = torch.where(batch["attention_mask"] == 1, batch["input_ids"], IGNORE)
    labels[:, 1:] = torch.where(batch["targets"][:, :-1] != IGNORE, labels[:, 1:], IGNORE)
    with torch.no_grad():
        own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
    assert loss == float(own)  # the model's own loss, bit for bit


def test_micro_batches_and_shards_add_up_to_the_whole_batch(chat_task, model):
    whole = float(chat_task.closure(model, 2)())
    micro = build_task(chat_task.config.model_copy(update={"micro_batch_size": 1}), "tiny-chat", rows=CHATS)
    assert math.isclose(micro.closure(model, 2)(), whole, rel_tol=1e-6)
    parts = [chat_task.slice_closure(model, 2, rank, 2)() for rank in range(2)]
    assert math.isclose(sum(s for s, _ in parts) / sum(c for _, c in parts), whole, rel_tol=1e-6)


def test_evaluation_gives_held_out_loss_and_perplexity_weighted_by_tokens(chat_task, model):
    metrics = chat_task.evaluate(model)
    total, count = reference_nll(model, chat_task.eval_examples)
    assert metrics.keys() == {"loss", "perplexity"}
    assert math.isclose(metrics["loss"], total / count, rel_tol=1e-6)
    assert metrics["perplexity"] == math.exp(metrics["loss"])
    assert (chat_task.metric, chat_task.higher_is_better) == ("loss", False)
    summary = chat_task.summary()
    assert (summary["kind"], summary["format"], summary["train_rows"], summary["eval_rows"]) == \
        ("sft", "conversational_language_modeling", 8, 4)


def greedy(model, ids: list[int], stop: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    return new[:next((i for i, t in enumerate(new) if t in stop), len(new))]


@pytest.mark.parametrize("rows,stop", [(CHATS, [EOS, IM_END]), (PAIRS, [EOS])], ids=["messages", "prompt-completion"])
def test_samples_are_greedy_generations_from_held_out_prompts(model, rows, stop):
    task = build_task(TaskConfig(kind="sft", eval_size=4, eval_generations=3, max_new_tokens=6), "tiny-chat",
                      rows=rows)
    assert task.stop_ids == stop
    samples = task.samples(model)
    assert samples == task.samples(model) and len(samples) == 3
    tok = chat_tokenizer()
    for (prompt, text), ex in zip(samples, task.eval_examples):
        assert prompt == ex.prompt_text
        assert text == tok.decode(greedy(model, ex.prompt_ids, stop, 6), skip_special_tokens=True)
    if rows is CHATS:  # the turns before the last assistant turn, and the generation prompt
        first = next(r for r in CHATS if r["messages"][0]["content"] in samples[0][0])
        assert samples[0][0] == tok.apply_chat_template(first["messages"][:3], tokenize=False,
                                                        add_generation_prompt=True)
        assert samples[0][0].endswith("<|im_start|>assistant\n")
    else:
        assert samples[0][0] in [r["prompt"] for r in PAIRS]


def test_a_generation_stops_at_the_end_of_the_turn(chat_task):
    model = build_model("tiny-chat", seed=1)
    ex = chat_task.eval_examples[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ex.prompt_ids])).logits[0, -1]
        first = int(logits.argmax())
        assert float(logits[first]) > 0
        model.lm_head.weight[IM_END] = 10 * model.lm_head.weight[first]  # <|im_end|> now wins the first step
    assert chat_task.samples(model)[0] == (ex.prompt_text, "")


def test_language_modelling_rows_have_no_prompt_to_generate_from(model):
    task = build_task(TaskConfig(kind="sft", eval_size=2), "tiny-chat", rows=[{"text": f"line {i}"} for i in range(5)])
    assert task.samples(model) == [] and task.stop_ids == [EOS]


TEXTS = ["Hello.", "h\u00e9llo w\u00f6rld \u2713 \u65e5\u672c", "  two  spaces\nnew\tline\x00", "</s> <|im_end|>", ""]


def test_tiny_chat_has_a_hugging_face_tokenizer_with_one_id_per_byte_and_its_specials():
    tok = load_tokenizer(None, 261, "auto", "tiny-chat")
    assert isinstance(tok, HFTokenizer)
    assert (tok.vocab_size, tok.pad_id, tok.eos_id, tok.adds_bos) == (261, 0, 258, True)
    hf = tok.tokenizer
    assert hf.chat_template == CHAT_TEMPLATE
    assert hf("h\u00e9")["input_ids"] == [1, 2 + ord("h"), 2 + 0xC3, 2 + 0xA9]
    assert hf("a</s><|im_start|><|im_end|>")["input_ids"] == [1, 2 + ord("a"), 258, 259, 260]
    assert [tok.decode(hf(t)["input_ids"]) for t in TEXTS[:3]] == TEXTS[:3]
    assert isinstance(load_tokenizer(None, 261, "byte", "tiny-chat"), ByteTokenizer)
    assert isinstance(load_tokenizer(None, 128, "auto", "tiny-llama"), ByteTokenizer)


def test_tiny_chats_snapshot_files_load_back_as_its_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    for name, text in snapshot_tokenizer_files(None, 261, "auto", "tiny-chat").items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    loaded, run = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True), chat_tokenizer()
    assert [loaded(t)["input_ids"] for t in TEXTS] == [run(t)["input_ids"] for t in TEXTS]
    assert loaded.chat_template == run.chat_template == CHAT_TEMPLATE
    messages = CHATS[0]["messages"]
    assert loaded.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True) == \
        run.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    assert isinstance(load_tokenizer(tmp_path, 261), HFTokenizer)  # a run from the snapshot: the same tokenizer


def test_a_saved_tiny_chat_directory_builds_the_same_task_as_the_name(tmp_path):
    build_model("tiny-chat").save_pretrained(tmp_path)
    chat_tokenizer().save_pretrained(tmp_path)
    config = TaskConfig(kind="sft", eval_size=3)
    assert build_task(config, str(tmp_path), rows=CHATS).train_examples == \
        build_task(config, "tiny-chat", rows=CHATS).train_examples


def test_the_byte_level_snapshot_files_are_unchanged():
    def digests(vocab):
        return {k: hashlib.sha256(v.encode()).hexdigest()[:16] for k, v in byte_tokenizer_files(vocab).items()}
    config = "2c66b71bee08137d"
    assert digests(128) == {"tokenizer.json": "8343689d37662b68", "tokenizer_config.json": config}
    assert digests(300) == {"tokenizer.json": "ad5267faa63ea980", "tokenizer_config.json": config}


def test_the_example_in_docs_sft_md_runs():
    import re

    from support import REPO

    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "sft.md").read_text(), re.S)
    (code,) = [block for block in blocks if "build_task(" in block]  # the ZOTrainer's: test_zotrainer
    scope: dict = {}
    exec(compile(code, "docs/sft.md", "exec"), scope)
    assert (scope["task"].n_train, scope["task"].n_eval, scope["task"].sft_format) == (6, 2, "prompt_completion")
    assert scope["metrics"].keys() == {"loss", "perplexity"} and len(scope["samples"]) == 2
    assert float(scope["loss"]) == float(scope["task"].loss(scope["model"], scope["task"].batch(0)))
