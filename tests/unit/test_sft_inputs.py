"""Kind `sft`'s rows: the same rows from JSONL, Parquet, a `save_to_disk` folder, a `datasets.Dataset` or a list of
dicts give the same examples and fingerprint; bad input gets one line naming the row (file:line, or "dataset row
N") or the setting, and the fix, from `build_task`, before any model exists."""

from __future__ import annotations

import hashlib
import json

import pytest
from datasets import Dataset, DatasetDict

from zocheck_ray.workload import TaskConfig, build_task, sft_fingerprint
from zocheck_ray.workload.errors import DataFormatError, DatasetRowError, TaskModelMismatchError, WorkloadError
from zocheck_ray.workload.tokenization import chat_tokenizer


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


CHATS = [{"messages": [turn("system", "Be kind."), turn("user", f"Question {i}: caf\u00e9?"),
                       turn("assistant", f"Answer {i} \u2713")]} for i in range(8)]
CHATS[2] = {"messages": [turn("user", "time?"), {"role": "tool", "content": "12:00", "name": "clock"},
                         turn("assistant", "noon")]}  # a key other messages lack: datasets fills it with null
PAIRS = [{"prompt": f"Q{i} \u65e5\u672c", "completion": f" A{i}"} for i in range(8)]


def sources(tmp_path, rows) -> dict[str, dict]:
    """The same rows as each source `build_task` reads: {name: build_task keywords}."""
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    return {"jsonl": {"data_path": str(jsonl)}, "parquet": {"data_path": str(tmp_path / "rows.parquet")},
            "save_to_disk": {"data_path": str(tmp_path / "saved")}, "dataset": {"rows": Dataset.from_list(rows)},
            "list": {"rows": rows}}


@pytest.mark.parametrize("rows", [CHATS, PAIRS], ids=["messages", "prompt-completion"])
def test_every_source_gives_the_same_examples_and_fingerprint(tmp_path, rows):
    tasks = {}
    for name, given in sources(tmp_path, rows).items():
        config = TaskConfig(kind="sft", eval_size=3, data_path=given.get("data_path"))
        tasks[name] = build_task(config, "tiny-chat", rows=given.get("rows"))
    first = tasks["list"]
    assert (first.n_train, first.n_eval) == (5, 3)
    for name, task in tasks.items():
        assert task.train_examples == first.train_examples, name
        assert task.eval_examples == first.eval_examples, name
        assert task.fingerprint == first.fingerprint == sft_fingerprint(rows), name
    canonical = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False, separators=(",", ":")) + "\n" for r in rows)
    assert first.fingerprint == hashlib.sha256(canonical.encode()).hexdigest()


def test_the_fingerprint_changes_with_any_row_and_with_their_order():
    base = sft_fingerprint(PAIRS)
    assert sft_fingerprint(PAIRS[::-1]) != base
    assert sft_fingerprint([*PAIRS[:-1], {"prompt": "Q7 \u65e5\u672c", "completion": " A7!"}]) != base
    assert sft_fingerprint([{**r, "id": i} for i, r in enumerate(PAIRS)]) == base  # other columns are not read


def test_a_dataset_dict_gives_its_splits_and_eval_rows_are_held_out_as_given():
    splits = DatasetDict({"train": Dataset.from_list(PAIRS[:6]), "validation": Dataset.from_list(PAIRS[6:])})
    task = build_task(TaskConfig(kind="sft"), "tiny-chat", rows=splits)
    apart = build_task(TaskConfig(kind="sft"), "tiny-chat", rows=PAIRS[:6], eval_rows=PAIRS[6:])
    assert (task.n_train, task.n_eval) == (6, 2)
    assert task.train_examples == apart.train_examples and task.eval_examples == apart.eval_examples
    assert task.fingerprint == apart.fingerprint == sft_fingerprint(PAIRS)


def write(tmp_path, rows: list) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def refused_file(tmp_path, rows, **settings) -> tuple[str, str]:
    path = write(tmp_path, rows)
    with pytest.raises(DataFormatError) as exc:
        build_task(TaskConfig(kind="sft", data_path=path, eval_size=1, **settings), "tiny-chat")
    return path, one_line(exc)


def refused_rows(rows, model="tiny-chat", **kwargs) -> str:
    with pytest.raises(DatasetRowError) as exc:
        build_task(TaskConfig(kind="sft", eval_size=1), model, rows=rows, **kwargs)
    return one_line(exc)


def test_a_row_with_no_formats_columns_names_its_columns_and_each_formats(tmp_path):
    path, text = refused_file(tmp_path, [PAIRS[0], {"prompt": "only a prompt", "id": 3}, PAIRS[1]])
    assert text.startswith(f"{path}:2: no SFT format's columns (the row has ['id', 'prompt'])")
    assert "'text' (language modelling; the column is task.text_field), 'messages' (conversational), or 'prompt' " \
           "and 'completion' (prompt-completion)" in text


def test_rows_of_mixed_formats_name_the_row_and_the_first(tmp_path):
    path, text = refused_file(tmp_path, [{"text": "plain"}, {"text": "more"}, CHATS[0]])
    assert text == (f"{path}:3: the row is conversational language modeling but the first row ({path}:1) is "
                    "language modeling; a dataset holds one format (as TRL reads it)")


def test_a_role_outside_the_four_is_refused_naming_the_message():
    rows = [CHATS[0], {"messages": [turn("user", "hi"), turn("bot", "hello")]}]
    assert refused_rows(rows) == ("dataset row 1: messages[1] has role 'bot'; a role is one of system, user, "
                                  "assistant, tool")


def test_a_message_without_role_or_content_is_refused():
    assert refused_rows([{"messages": [{"role": "user"}, turn("assistant", "x")]}] * 2) == (
        "dataset row 0: messages[0] has no 'content' (it has ['role']); a message needs 'role' and 'content'")
    assert refused_rows([CHATS[0], {"messages": [{"content": "hi"}, turn("assistant", "x")]}]) == (
        "dataset row 1: messages[0] has no 'role' (it has ['content']); a message needs 'role' and 'content'")


def test_a_conversation_with_no_assistant_turn_is_refused(tmp_path):
    path, text = refused_file(tmp_path, [CHATS[0], {"messages": [turn("system", "s"), turn("user", "u")]}])
    assert text == (f"{path}:2: the conversation has no assistant turn, so nothing in it is the model's to learn; "
                    "add the assistant's reply (role 'assistant')")
    text = refused_rows([{"prompt": [turn("user", "u")], "completion": [turn("user", "not the assistant")]}] * 2)
    assert text.startswith("dataset row 0: the completion has no assistant turn")


def test_a_string_prompt_with_a_message_completion_is_refused():
    text = refused_rows([PAIRS[0], {"prompt": "text", "completion": [turn("assistant", "x")]}])
    assert text == ("dataset row 1: 'prompt' and 'completion' must both be strings (prompt-completion) or both lists "
                    "of messages (conversational prompt-completion), got str and list")


def test_conversational_rows_with_a_tokenizer_without_a_chat_template_are_refused():
    tokenizer = chat_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(WorkloadError) as exc:
        build_task(TaskConfig(kind="sft", eval_size=1), "tiny-chat", tokenizer=tokenizer, rows=CHATS)
    assert one_line(exc) == (
        f"the rows are conversational (dataset row 0) but the tokenizer ({type(tokenizer).__name__} given to "
        "build_task) has no chat template to render them; use a model whose tokenizer has one (tiny-chat), or set "
        "tokenizer.chat_template and save it with the model")


def test_assistant_only_loss_with_a_template_that_cannot_mark_the_assistant_is_refused():
    tokenizer = chat_tokenizer()
    tokenizer.chat_template = tokenizer.chat_template.replace("{%- generation %}", "").replace(
        "{%- endgeneration %}", "")
    with pytest.raises(WorkloadError) as exc:
        build_task(TaskConfig(kind="sft", eval_size=1, assistant_only_loss=True), "tiny-chat", tokenizer=tokenizer,
                   rows=CHATS)
    assert one_line(exc).startswith(f"task.assistant_only_loss: the chat template of {type(tokenizer).__name__} given "
                                    "to build_task has no {% generation %} markers, so its assistant tokens cannot be "
                                    "marked, and TRL has no training template for it; add {% generation %}")


@pytest.mark.parametrize("rows,settings,start", [
    (PAIRS, {"assistant_only_loss": True}, "task.assistant_only_loss needs conversational rows (messages), but the "
                                           "rows are prompt completion (dataset row 0); TRL refuses it too"),
    ([{"text": "a"}, {"text": "b"}], {"completion_only_loss": True},
     "task.completion_only_loss=True needs prompt-completion rows, but the rows are language modeling (dataset row "
     "0), which have no completion (TRL ignores the setting there); unset it"),
])
def test_a_loss_setting_the_format_cannot_honour_names_the_setting(rows, settings, start):
    with pytest.raises(WorkloadError) as exc:
        build_task(TaskConfig(kind="sft", **settings), "tiny-chat", rows=rows, eval_rows=rows)
    assert one_line(exc).startswith(start)


def test_a_byte_level_tokenizer_is_refused_for_sft():
    with pytest.raises(WorkloadError) as exc:
        build_task(TaskConfig(kind="sft", max_length=64, eval_size=1), "tiny-llama", rows=PAIRS)
    assert one_line(exc) == (
        "task kind 'sft' tokenizes as TRL does, with the model's own Hugging Face tokenizer, but this run's is "
        "byte-level (vocab 128), whose ids a pretrained model does not know and which has no EOS or chat template; "
        "use a model directory saved with its tokenizer, or model tiny-chat, and task.tokenizer 'auto' or 'model'")
    with pytest.raises(WorkloadError, match="byte-level \\(vocab 261\\)"):
        build_task(TaskConfig(kind="sft", tokenizer="byte", eval_size=1), "tiny-chat", rows=PAIRS)


def test_an_encoder_is_refused_for_sft():
    with pytest.raises(TaskModelMismatchError, match="task kind 'sft' needs a causal LM, but model 'tiny-bert'"):
        build_task(TaskConfig(kind="sft", max_length=64), "tiny-bert", rows=PAIRS)


def test_rows_in_memory_and_a_data_path_or_another_kind_are_refused_and_no_path_reads_the_shipped_chats(tmp_path):
    with pytest.raises(WorkloadError, match="^rows were handed to build_task and task.data_path/eval_path are set "
                                            "too; give one$"):
        build_task(TaskConfig(kind="sft", data_path=write(tmp_path, PAIRS)), "tiny-chat", rows=PAIRS)
    with pytest.raises(WorkloadError, match="^rows handed to build_task are SFT rows \\(task.kind 'sft'\\); kind "
                                            "'lm' reads task.data_path$"):
        build_task(TaskConfig(kind="lm"), "tiny-llama", rows=PAIRS)
    shipped = build_task(TaskConfig(kind="sft", eval_size=8), "tiny-chat")  # no data_path: the shipped chats
    assert shipped.sft_format == "conversational_language_modeling" and shipped.n_train == 152


def test_sft_settings_on_another_kind_are_refused_by_the_config():
    with pytest.raises(ValueError, match="task.assistant_only_loss=True: settings of kind 'sft' \\(TRL's\\), which "
                                         "kind 'lm' does not read"):
        TaskConfig(kind="lm", assistant_only_loss=True)
    assert TaskConfig.model_validate(TaskConfig(kind="lm").model_dump()).kind == "lm"  # a dumped config reloads


def test_kind_sft_takes_trls_defaults_where_they_differ_from_ours():
    config = TaskConfig(kind="sft")
    assert (config.max_length, config.text_field, config.truncation_mode) == (1024, "text", "keep_start")
    assert (config.completion_only_loss, config.assistant_only_loss) == (None, False)
    assert (TaskConfig().max_length, TaskConfig().text_field) == (64, "sentence")
    assert TaskConfig(kind="sft", max_length=32, text_field="body").max_length == 32


def test_the_text_field_names_the_language_modelling_column():
    task = build_task(TaskConfig(kind="sft", text_field="body", eval_size=1), "tiny-chat",
                      rows=[{"body": "x"}, {"body": "y"}])
    assert task.sft_format == "language_modeling" and task.train_examples[0].input_ids[-1] == 258  # EOS


def test_a_row_left_without_trained_tokens_is_dropped_with_a_warning_naming_it(caplog):
    rows = [*PAIRS, {"prompt": "a long prompt " * 10, "completion": " cut off"}]
    task = build_task(TaskConfig(kind="sft", max_length=32), "tiny-chat", rows=rows, eval_rows=PAIRS[:2])
    assert task.n_train == len(PAIRS) and task.dropped == 1 and task.summary()["dropped_rows"] == 1
    assert "1 SFT row(s) have no trained token left within task.max_length=32 (keep_start) and are dropped, as TRL " \
           "drops them: dataset row 8" in caplog.text
