"""Kind `sft` against TRL itself: the same rows prepared by TRL 1.16's `SFTTrainer` (its `train_dataset` after
`_prepare_dataset`, its collator, its loss) and by ours give equal input ids and loss masks on every row, in all
four formats, under completion_only_loss on and off, assistant_only_loss, and truncation in both modes; and the
loss on the same model agrees to 1e-6. The model is `tiny-chat` saved with `save_pretrained`: a small
Llama-architecture model built from a config, with a chat template."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("trl")  # the test extra brings it

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from zocheck_ray.workload import TaskConfig, build_model, build_task  # noqa: E402
from zocheck_ray.workload.data import batch_indices  # noqa: E402
from zocheck_ray.workload.tasks import IGNORE  # noqa: E402
from zocheck_ray.workload.tokenization import chat_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow  # each case builds a TRL trainer

LONG = "The quick brown fox jumps over the lazy dog; " * 4
TOOLS = json.dumps([{"type": "function", "function": {"name": "clock", "description": "the time",
                                                       "parameters": {"type": "object", "properties": {}}}}])


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


TEXT_ROWS = [{"text": t} for t in [
    "Hello world.", "h\u00e9llo w\u00f6rld \u2713 \u65e5\u672c\u8a9e", "ends with the EOS already</s>",
    "specials inside <|im_start|>user\n<|im_end|> and <s>", "two  spaces\nnew\tline", "", " leading space",
    LONG, LONG + "\u00e9\u00e9\u00e9", "a", "emoji \U0001F600 and \u00df", "numbers 1 2 3 4 5 6 7 8 9 10",
]]

MESSAGE_ROWS = [  # the first row has every column: Dataset.from_list takes its columns from it
    {"messages": [turn("user", "time?"), turn("assistant", "calling the clock"),
                  {"role": "tool", "content": "12:00", "name": "clock"}, turn("assistant", "It is noon.")],
     "tools": TOOLS},
    {"messages": [turn("user", "Hi"), turn("assistant", "Hello!")]},
    {"messages": [turn("system", "Be brief."), turn("user", "2+2?"), turn("assistant", "4")]},
    {"messages": [turn("user", "one"), turn("assistant", "1"), turn("user", "two"), turn("assistant", "2"),
                  turn("user", "three"), turn("assistant", "3")]},
    {"messages": [turn("user", "Wie sp\u00e4t?"), turn("assistant", "\u65e5\u672c \u2713")]},
    {"messages": [turn("user", LONG), turn("assistant", "short")]},
    {"messages": [turn("user", "tell a story"), turn("assistant", LONG)]},
    {"messages": [turn("assistant", "I speak first.")]},
    {"messages": [turn("user", "q"), turn("assistant", ""), turn("user", "again")]},
    {"messages": [turn("system", "sys"), turn("user", "a"), turn("assistant", "b"), turn("user", LONG),
                  turn("assistant", "c")]},
    {"messages": [turn("user", "literal </s> and <|im_end|>"), turn("assistant", "ok </s>")]},
    {"messages": [turn("user", "x"), turn("assistant", "y")]},
]

PC_ROWS = [
    {"prompt": "The sky is", "completion": " blue."},
    {"prompt": "Capital of France:", "completion": " Paris"},
    {"prompt": "\u65e5\u672c\u306e\u9996\u90fd\u306f", "completion": "\u6771\u4eac\u3067\u3059"},
    {"prompt": "already ends", "completion": " with EOS</s>"},
    {"prompt": "", "completion": "no prompt at all"},
    {"prompt": "no completion", "completion": ""},
    {"prompt": LONG, "completion": " after a long prompt"},
    {"prompt": "Write:", "completion": LONG},
    {"prompt": "multi\nline", "completion": "\nanswer\n"},
    {"prompt": "ends with a space ", "completion": "x"},
    {"prompt": "caf\u00e9", "completion": " cr\u00e8me br\u00fbl\u00e9e"},
    {"prompt": "<|im_start|>", "completion": "<|im_end|>"},
]

CONV_PC_ROWS = [
    {"prompt": [turn("user", "time?")],
     "completion": [turn("assistant", "checking"), {"role": "tool", "content": "12:00", "name": "clock"},
                    turn("assistant", "noon")], "tools": TOOLS},
    {"prompt": [turn("user", "Hi")], "completion": [turn("assistant", "Hello!")]},
    {"prompt": [turn("system", "Be brief."), turn("user", "2+2?")], "completion": [turn("assistant", "4")]},
    {"prompt": [turn("user", "one"), turn("assistant", "1"), turn("user", "two")],
     "completion": [turn("assistant", "2")]},
    {"prompt": [turn("user", "\u00bfQu\u00e9 tal?")], "completion": [turn("assistant", "Bien \u2713")]},
    {"prompt": [turn("user", LONG)], "completion": [turn("assistant", "short")]},
    {"prompt": [turn("user", "story")], "completion": [turn("assistant", LONG)]},
    {"prompt": [turn("user", "empty reply")], "completion": [turn("assistant", "")]},
    {"prompt": [turn("system", "s"), turn("user", "u")], "completion": [turn("assistant", "a </s>")]},
    {"prompt": [turn("user", "x")], "completion": [turn("assistant", "y")]},
]

ROWS = {"language_modeling": TEXT_ROWS, "conversational_language_modeling": MESSAGE_ROWS,
        "prompt_completion": PC_ROWS, "conversational_prompt_completion": CONV_PC_ROWS}


EVAL_ROWS = {"language_modeling": [{"text": "held out"}],
             "conversational_language_modeling": [{"messages": [turn("user", "q"), turn("assistant", "a")]}],
             "prompt_completion": [{"prompt": "q", "completion": " a"}],
             "conversational_prompt_completion": [{"prompt": [turn("user", "q")],
                                                   "completion": [turn("assistant", "a")]}]}
"""A held-out row per format: given apart, every row above is a training row, in order."""


def ours(model_dir, fmt: str, settings: dict, tokenizer=None, rows=None):
    """Our examples of `rows` (the format's test rows) from a `Dataset`, in order."""
    task = build_task(TaskConfig(kind="sft", **settings), str(model_dir), tokenizer=tokenizer,
                      rows=Dataset.from_list(rows or ROWS[fmt]), eval_rows=EVAL_ROWS[fmt])
    return task.train_examples


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """tiny-chat saved with save_pretrained: config, weights, tokenizer and chat template."""
    directory = tmp_path_factory.mktemp("tiny-chat")
    build_model("tiny-chat", seed=3).save_pretrained(directory)
    chat_tokenizer().save_pretrained(directory)
    return directory


def trl_trainer(model_dir, rows, tmp_path, chat_template: str | None = None, **settings) -> SFTTrainer:
    """TRL's own trainer on `rows`, its defaults but `settings` (each TRL's SFTConfig field of that name)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    args = SFTConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, bf16=False, **settings)
    return SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args,
                      train_dataset=Dataset.from_list(rows), processing_class=tokenizer)


def assert_same_as_trl(trainer: SFTTrainer, ours) -> None:
    theirs = trainer.train_dataset
    assert len(ours) == len(theirs)
    for i, (example, row) in enumerate(zip(ours, theirs)):
        assert example.input_ids == row["input_ids"], i
        assert example.loss_mask == [int(label != -100) for label in row["labels"]], i
        assert all(label in (-100, token) for label, token in zip(row["labels"], row["input_ids"]))


CASES = [
    ("language_modeling", {}),
    ("language_modeling", {"max_length": 24}),
    ("language_modeling", {"max_length": 24, "truncation_mode": "keep_end"}),
    ("conversational_language_modeling", {}),
    ("conversational_language_modeling", {"assistant_only_loss": True}),
    ("conversational_language_modeling", {"assistant_only_loss": True, "max_length": 40}),
    ("conversational_language_modeling", {"assistant_only_loss": True, "max_length": 40,
                                          "truncation_mode": "keep_end"}),
    ("conversational_language_modeling", {"max_length": 40, "truncation_mode": "keep_end"}),
    ("prompt_completion", {}),
    ("prompt_completion", {"completion_only_loss": False}),
    ("prompt_completion", {"max_length": 20}),
    ("prompt_completion", {"max_length": 20, "truncation_mode": "keep_end"}),
    ("prompt_completion", {"completion_only_loss": False, "max_length": 20}),
    ("conversational_prompt_completion", {}),
    ("conversational_prompt_completion", {"completion_only_loss": False}),
    ("conversational_prompt_completion", {"assistant_only_loss": True}),
    ("conversational_prompt_completion", {"assistant_only_loss": True, "completion_only_loss": False}),
    ("conversational_prompt_completion", {"max_length": 48}),
    ("conversational_prompt_completion", {"assistant_only_loss": True, "max_length": 48,
                                          "truncation_mode": "keep_end"}),
]


@pytest.mark.parametrize("fmt,settings", CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_ids_and_loss_masks_equal_trls_on_every_row(model_dir, tmp_path, fmt, settings):
    trainer = trl_trainer(model_dir, ROWS[fmt], tmp_path, **settings)
    examples = ours(model_dir, fmt, settings)
    assert_same_as_trl(trainer, examples)
    masked = settings.get("assistant_only_loss") or ("prompt" in fmt and settings.get("completion_only_loss", True))
    assert any(0 in e.loss_mask for e in examples) if masked else all(set(e.loss_mask) == {1} for e in examples)


def test_truncation_drops_the_rows_trl_drops(model_dir, tmp_path):
    # keep_start at 20 tokens leaves the long prompt without its completion: TRL drops that row, and so do we
    trainer = trl_trainer(model_dir, PC_ROWS, tmp_path, max_length=20)
    assert len(ours(model_dir, "prompt_completion", {"max_length": 20})) == len(trainer.train_dataset) == \
        len(PC_ROWS) - 1


def test_a_known_template_without_generation_markers_is_swapped_for_trls_training_template(model_dir, tmp_path):
    from trl.chat_template_utils import qwen2_5_chat_template

    trainer = trl_trainer(model_dir, MESSAGE_ROWS, tmp_path, chat_template=qwen2_5_chat_template,
                          assistant_only_loss=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = qwen2_5_chat_template
    fmt, settings = "conversational_language_modeling", {"assistant_only_loss": True}
    swapped = ours(model_dir, fmt, settings, tokenizer=tokenizer)
    assert_same_as_trl(trainer, swapped)
    assert swapped[0].input_ids != ours(model_dir, fmt, settings)[0].input_ids  # Qwen's template, not tiny-chat's


LOSS_CASES = [("language_modeling", {"max_length": 40}), ("conversational_language_modeling",
                                                             {"assistant_only_loss": True}),
              ("prompt_completion", {}), ("conversational_prompt_completion", {"max_length": 48})]


@pytest.mark.parametrize("fmt,settings", LOSS_CASES, ids=[f for f, _ in LOSS_CASES])
def test_the_loss_on_the_same_model_equals_trls_at_1e_6(model_dir, tmp_path, fmt, settings):
    rows = [r for r in ROWS[fmt] if LONG not in json.dumps(r)]  # no row dropped: TRL's index i is our row i
    trainer = trl_trainer(model_dir, rows, tmp_path, **settings)
    config = TaskConfig(kind="sft", batch_size=6, data_seed=5, **settings)
    task = build_task(config, str(model_dir), rows=Dataset.from_list(rows), eval_rows=EVAL_ROWS[fmt])
    assert_same_as_trl(trainer, task.train_examples)
    ours_model = build_model(str(model_dir))
    for step in range(3):
        indices = batch_indices(config.data_seed, step, config.batch_size, task.n_train)
        theirs = trainer.data_collator([trainer.train_dataset[i] for i in indices])
        batch = task.batch(step)
        assert torch.equal(batch["input_ids"], theirs["input_ids"])
        assert torch.equal(batch["attention_mask"], theirs["attention_mask"])
        assert torch.equal(batch["targets"][:, :-1], theirs["labels"][:, 1:])  # position t predicts t + 1
        assert bool((batch["targets"][:, -1] == IGNORE).all())
        ours = task.loss(ours_model, batch)
        with torch.no_grad():
            model_loss = trainer.model(**theirs).loss
            trainer_loss = trainer.compute_loss(trainer.model, dict(theirs))
        assert float(ours) == float(model_loss)  # the model's own loss, computed as it computes it
        assert abs(float(ours) - float(trainer_loss)) <= 1e-6  # TRL's fused head adds in its own order
