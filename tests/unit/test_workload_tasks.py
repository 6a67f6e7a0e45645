"""Tasks: deterministic batches, the data they come from, and what loss and evaluation compute."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
import torch.nn.functional as F

from zocheck_ray.workload import SHIPPED_SST2, TaskConfig, build_model, build_task, read_rows
from zocheck_ray.workload.data import batch_indices, encode

ROWS = [
    ("a warm and clever film", 1), ("the plot was dull", 0), ("simply lovely", 1), ("the cast is weak", 0),
    ('he said "wow, what a ride"', 1), ("boring,\nand far too long", 0), ("the score felt fresh", 1),
    ("what a lame script", 0),
]


def write_jsonl(path):
    path.write_text("".join(json.dumps({"text": t, "y": y}) + "\n" for t, y in ROWS))
    return str(path)


def write_csv(path):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["y", "text"])
        writer.writerows([(y, t) for t, y in ROWS])
    return str(path)


def same_batch(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def sst2():
    return build_task(TaskConfig(), "tiny-opt")


def test_batch_is_a_pure_function_of_data_seed_and_step(sst2):
    again = build_task(TaskConfig(), "tiny-opt")
    assert same_batch(sst2.batch(7), sst2.batch(7))
    assert same_batch(sst2.batch(7), again.batch(7))
    assert not same_batch(sst2.batch(7), sst2.batch(8))
    other_seed = build_task(TaskConfig(data_seed=1), "tiny-opt")
    assert not same_batch(sst2.batch(7), other_seed.batch(7))


def test_batch_leaves_global_rng_alone(sst2):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    sst2.batch(3)
    sst2.evaluate(build_model("tiny-opt"))
    assert torch.equal(torch.rand(4), expected)


def test_batch_rows_follow_batch_indices(sst2):
    rows = batch_indices(0, 11, sst2.config.batch_size, sst2.n_train)
    expected = torch.tensor([sst2.train_examples[i].label for i in rows])
    assert torch.equal(sst2.batch(11)["labels"], expected)


def test_shipped_data_split(sst2):
    assert (sst2.n_train, sst2.n_eval) == (384, 96)
    assert sst2.summary() == {"kind": "sst2", "train_rows": 384, "eval_rows": 96, "metric": "accuracy",
                              "tokenizer": "byte-level (vocab 128)"}


def test_prompt_batch_layout(tmp_path):
    """Each row gives one sequence per word: prompt ids then word ids; only the word's tokens are targets.

    As MeZO's encode_prompt: every token after "<text> It was" is the candidate's, its space included, although
    both words begin with it.
    """
    path = write_jsonl(tmp_path / "rows.jsonl")
    task = build_task(TaskConfig(data_path=path, eval_path=path, text_field="text", label_field="y",
                                 batch_size=3), "tiny-opt")
    batch = task.batch(0)
    rows = batch_indices(0, 0, 3, len(ROWS))
    assert batch["input_ids"].shape[0] == 6 and torch.equal(batch["labels"], torch.tensor([ROWS[i][1] for i in rows]))
    for r, (i, word) in enumerate((i, w) for i in rows for w in ("terrible", "great")):
        prompt = encode(f"{ROWS[i][0].strip()} It was", 128)
        option = encode(" " + word, 128)[1:]  # without the start id
        n = len(prompt) + len(option)
        assert batch["input_ids"][r, :n].tolist() == prompt + option
        assert batch["attention_mask"][r].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
        targets = batch["targets"][r]
        assert targets[len(prompt) - 1:n - 1].tolist() == option
        assert (targets != -100).sum() == len(option)


def test_jsonl_and_csv_give_the_same_batches(tmp_path):
    fields = dict(text_field="text", label_field="y", eval_size=2, batch_size=4)
    from_jsonl = build_task(TaskConfig(data_path=write_jsonl(tmp_path / "rows.jsonl"), **fields), "tiny-opt")
    from_csv = build_task(TaskConfig(data_path=write_csv(tmp_path / "rows.csv"), **fields), "tiny-opt")
    assert from_jsonl.n_train == from_csv.n_train == 6
    for step in range(5):
        assert same_batch(from_jsonl.batch(step), from_csv.batch(step))


def test_csv_rows_keep_their_line_numbers(tmp_path):
    rows = read_rows(write_csv(tmp_path / "rows.csv"), "text", "y")
    assert [(r.line, r.label) for r in rows[4:7]] == [(6, "1"), (7, "0"), (9, "1")]  # row 6 spans two lines
    assert rows[5].text == "boring,\nand far too long"


def test_split_ignores_row_order(tmp_path):
    rows = read_rows(SHIPPED_SST2)
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("".join(json.dumps({"sentence": r.text, "label": r.label}) + "\n" for r in reversed(rows)))
    a = build_task(TaskConfig(), "tiny-opt")
    b = build_task(TaskConfig(data_path=str(shuffled)), "tiny-opt")
    assert sorted(e.sequences for e in a.eval_examples) == sorted(e.sequences for e in b.eval_examples)


def test_long_prompts_lose_their_start_never_the_word_nor_the_start_token(tmp_path):
    """MeZO's truncation: the start token, then the last max_length - 1 tokens."""
    path = tmp_path / "long.jsonl"
    text = "x" * 200 + " but the ending was dull"
    path.write_text(json.dumps({"sentence": text, "label": 0}) + "\n")
    task = build_task(TaskConfig(data_path=str(path), eval_path=str(path), max_length=40, batch_size=1), "tiny-opt")
    ids = task.batch(0)["input_ids"]
    assert ids.shape == (2, 40)
    assert ids[0].tolist() == [1] + encode(text + " It was terrible", 128)[-39:]
    assert ids[1].tolist()[-9:] == encode(text + " It was great", 128)[-9:]


def test_evaluation_does_not_depend_on_chunking():
    model = build_model("tiny-opt", seed=4)
    whole = build_task(TaskConfig(eval_batch_size=96), "tiny-opt").evaluate(model)
    chunked = build_task(TaskConfig(eval_batch_size=7), "tiny-opt").evaluate(model)
    assert whole["accuracy"] == chunked["accuracy"]
    assert math.isclose(whole["loss"], chunked["loss"], rel_tol=1e-6)


def test_prompt_loss_is_cross_entropy_over_candidate_scores(sst2):
    model = build_model("tiny-opt", seed=1)
    batch = sst2.batch(2)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        scores = []
        for r in range(batch["input_ids"].shape[0]):
            where = (batch["targets"][r] != -100).nonzero().squeeze(-1)
            log_probs = logits[r, where].log_softmax(-1).gather(-1, batch["targets"][r, where, None]).squeeze(-1)
            scores.append(log_probs.mean())
        expected = F.cross_entropy(torch.stack(scores).view(-1, 2), batch["labels"])
        assert torch.allclose(sst2.loss(model, batch), expected, rtol=1e-6, atol=0)


def test_lm_loss_matches_the_models_own_loss(tmp_path):
    path = tmp_path / "lines.jsonl"
    path.write_text("".join(json.dumps({"text": "abcdefgh"[i:] + "ijklmnop"[:i]}) + "\n" for i in range(8)))
    task = build_task(TaskConfig(kind="lm", data_path=str(path), text_field="text", eval_size=2, batch_size=4),
                      "tiny-llama")
    model = build_model("tiny-llama", seed=2)
    batch = task.batch(0)  # equal lengths: no padding, so the model's own mean is the same quantity
    with torch.no_grad():
        own = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        assert torch.allclose(task.loss(model, batch), own, rtol=1e-6, atol=0)
    metrics = task.evaluate(model)
    assert set(metrics) == {"loss", "perplexity"} and math.isclose(metrics["perplexity"], math.exp(metrics["loss"]))
    assert task.metric == "loss" and not task.higher_is_better


def test_lm_padding_is_not_a_target():
    task = build_task(TaskConfig(kind="lm", batch_size=8), "tiny-opt")
    batch = task.batch(0)
    lengths = batch["attention_mask"].sum(-1)
    assert torch.equal((batch["targets"] != -100).sum(-1), lengths - 1)


@pytest.mark.parametrize("model_name", ["tiny-opt", "tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_prompt_task_runs_on_every_causal_architecture_and_dtype(sst2, model_name, dtype):
    model = build_model(model_name, dtype, seed=0)
    with torch.no_grad():
        loss = sst2.loss(model, sst2.batch(0))
    assert loss.dtype == torch.float32 and loss.dim() == 0 and math.isfinite(float(loss))
    assert 0.5 < float(loss) < 1.0  # two near-uniform candidates at initialisation: about ln 2


def test_classification_task_on_tiny_bert():
    task = build_task(TaskConfig(kind="classification"), "tiny-bert")
    batch = task.batch(0)
    assert batch["input_ids"][:, 0].eq(1).all()  # the byte tokenizer's start id stands in for [CLS]
    model = build_model("tiny-bert", seed=0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        assert torch.allclose(task.loss(model, batch), F.cross_entropy(logits, batch["labels"]), rtol=1e-6, atol=0)
    metrics = task.evaluate(model)
    assert set(metrics) == {"accuracy", "loss"} and 0.0 <= metrics["accuracy"] <= 1.0


def test_closure_is_the_loss_of_that_steps_batch(sst2):
    model = build_model("tiny-opt", seed=0)
    with torch.no_grad():
        assert torch.equal(sst2.closure(model, 5)(), sst2.loss(model, sst2.batch(5)))
