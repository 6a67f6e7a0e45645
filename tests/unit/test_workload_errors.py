"""Bad workload input fails in `build_task`/`build_model`, before any training, naming what to fix."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from zocheck_ray.workload import (
    DataFileError,
    DataFormatError,
    LabelError,
    ModelNotFoundError,
    TaskConfig,
    TaskModelMismatchError,
    WorkloadError,
    build_model,
    build_task,
)


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


GOOD = [json.dumps({"sentence": "a warm film", "label": 1}), json.dumps({"sentence": "a dull film", "label": 0})]


def task_on(path, **fields):
    return build_task(TaskConfig(data_path=path, eval_size=1, **fields), "tiny-opt")


def test_every_workload_error_is_a_value_error():
    for cls in (ModelNotFoundError, DataFileError, DataFormatError, LabelError, TaskModelMismatchError):
        assert issubclass(cls, WorkloadError) and issubclass(cls, ValueError)


def test_missing_model_directory_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match=f"model '{missing}' is not a built-in model"):
        build_task(TaskConfig(), str(missing))
    with pytest.raises(ModelNotFoundError, match="or an existing directory"):
        build_model(str(missing))


def test_model_directory_without_config_is_named(tmp_path):
    with pytest.raises(ModelNotFoundError, match=f"model directory {tmp_path} has no config.json"):
        build_model(str(tmp_path))


def test_missing_data_file_is_named(tmp_path):
    with pytest.raises(DataFileError, match=f"data file {tmp_path / 'x.jsonl'} does not exist"):
        task_on(str(tmp_path / "x.jsonl"))


def test_unknown_data_suffix_asks_for_a_format(tmp_path):
    path = tmp_path / "rows.txt"
    path.write_text("whatever\n")
    with pytest.raises(DataFileError, match="cannot tell the format .* set task.data_format"):
        task_on(str(path))


def test_empty_data_file_is_an_error(tmp_path):
    with pytest.raises(DataFileError, match="holds no rows"):
        task_on(write_jsonl(tmp_path / "empty.jsonl", ["", "  "]))


def test_bad_json_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", GOOD + ['{"sentence": "oops", "label": 1'])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:3: not valid JSON") as info:
        task_on(path)
    assert info.value.line == 3 and info.value.path == path


def test_non_object_row_names_line(tmp_path):
    path = write_jsonl(tmp_path / "list.jsonl", [GOOD[0], "", '["a warm film", 1]'])
    with pytest.raises(DataFormatError, match=r"list\.jsonl:3: expected a JSON object, got list"):
        task_on(path)


def test_missing_field_names_field_and_line(tmp_path):
    path = write_jsonl(tmp_path / "field.jsonl", GOOD + [json.dumps({"text": "a warm film", "label": 1})])
    with pytest.raises(DataFormatError, match=r"field\.jsonl:3: missing field 'sentence' \(the row has \['label', 'text'\]\)"):
        task_on(path)


@pytest.mark.parametrize("row, problem", [
    ({"sentence": 42, "label": 1}, "field 'sentence' must be a string, got int 42"),
    ({"sentence": "   ", "label": 1}, "field 'sentence' is empty"),
    ({"sentence": "a warm film", "label": 1.0}, "field 'label' must be an integer or a string, got float 1.0"),
    ({"sentence": "a warm film", "label": True}, "field 'label' must be an integer or a string, got bool True"),
    ({"sentence": "a warm film", "label": None}, "field 'label' must be an integer or a string, got NoneType None"),
])
def test_wrong_types_name_field_and_line(tmp_path, row, problem):
    path = write_jsonl(tmp_path / "types.jsonl", GOOD + [json.dumps(row)])
    with pytest.raises(DataFormatError, match=r"types\.jsonl:3: " + problem.replace("(", r"\(").replace(")", r"\)")):
        task_on(path)


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes((GOOD[0] + "\n").encode() + b'{"sentence": "caf\xe9", "label": 1}\n')
    with pytest.raises(DataFormatError, match=r"bytes\.jsonl:2: not valid UTF-8"):
        task_on(str(path))


def test_csv_header_without_the_column(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("text,label\na warm film,1\n")
    with pytest.raises(DataFormatError, match=r"rows\.csv:1: the header has no column 'sentence' \(columns \['text', 'label'\]\)"):
        task_on(str(path))


def test_csv_row_with_wrong_column_count_names_line(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text('sentence,label\n"a warm,\nfilm",1\na dull film,0,extra\n')
    with pytest.raises(DataFormatError, match=r"rows\.csv:4: expected 2 columns as in the header, got 3"):
        task_on(str(path))


def test_csv_empty_label_names_line(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("sentence,label\na warm film,1\na dull film,\n")
    with pytest.raises(DataFormatError, match=r"rows\.csv:3: field 'label' is empty"):
        task_on(str(path))


def test_label_not_in_verbalizer_names_label_and_line(tmp_path):
    path = write_jsonl(tmp_path / "labels.jsonl", GOOD + [json.dumps({"sentence": "an odd film", "label": 2})])
    with pytest.raises(LabelError, match=r"labels\.jsonl:3: label 2 is not in the verbalizer \(labels \['0', '1'\]\)") as info:
        task_on(path)
    assert info.value.label == 2


def test_csv_label_not_in_verbalizer(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("sentence,label\na warm film,pos\na dull film,neg\nan odd film,meh\n")
    with pytest.raises(LabelError, match=r"rows\.csv:4: label 'meh' is not in the verbalizer \(labels \['neg', 'pos'\]\)"):
        task_on(str(path), verbalizer={"neg": "terrible", "pos": "great"})


def test_label_error_in_the_eval_file(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", GOOD)
    held_out = write_jsonl(tmp_path / "eval.jsonl", [json.dumps({"sentence": "so so", "label": "neutral"})])
    with pytest.raises(LabelError, match=r"eval\.jsonl:1: label 'neutral'"):
        build_task(TaskConfig(data_path=train, eval_path=held_out), "tiny-opt")


@pytest.mark.parametrize("sampler", [{"eval_size": 1}, {"num_train": 1, "num_eval": 1}])
def test_a_bad_row_is_refused_whether_or_not_it_is_sampled(tmp_path, sampler):
    """Rows are checked before sampling: evaluating one held-out row does not let a bad third one through."""
    train = write_jsonl(tmp_path / "train.jsonl", GOOD)
    held_out = write_jsonl(tmp_path / "eval.jsonl", GOOD + [json.dumps({"sentence": "so so", "label": 7})])
    with pytest.raises(LabelError, match=r"eval\.jsonl:3: label 7"):
        build_task(TaskConfig(data_path=train, eval_path=held_out, **sampler), "tiny-opt")


def test_prompt_task_on_an_encoder_is_a_mismatch():
    with pytest.raises(TaskModelMismatchError, match="task kind 'sst2' needs a causal LM, but model 'tiny-bert' is an "
                                                     r"encoder with a classification head \(BertForSequenceClassification\)"):
        build_task(TaskConfig(kind="sst2"), "tiny-bert")
    with pytest.raises(TaskModelMismatchError, match="task kind 'lm' needs a causal LM"):
        build_task(TaskConfig(kind="lm"), "tiny-bert")


def test_classification_on_a_causal_lm_is_a_mismatch():
    with pytest.raises(TaskModelMismatchError, match="task kind 'classification' needs a model with a classification "
                                                     "head, but model 'tiny-llama' is a causal LM"):
        build_task(TaskConfig(kind="classification"), "tiny-llama")


def test_label_count_must_match_the_head(tmp_path):
    config = TaskConfig(kind="classification", verbalizer={0: "", 1: "", 2: ""})
    with pytest.raises(TaskModelMismatchError, match="model 'tiny-bert' has 2 output classes but task.verbalizer has 3 "
                                                     r"labels .*overrides=\{'num_labels': 3\}"):
        build_task(config, "tiny-bert")
    path = write_jsonl(tmp_path / "three.jsonl", GOOD + [json.dumps({"sentence": "so so", "label": 2})])
    task = build_task(config.model_copy(update={"data_path": path, "eval_size": 1}), "tiny-bert",
                      overrides={"num_labels": 3})
    assert task.n_train + task.n_eval == 3


def test_sequences_longer_than_the_model_positions():
    with pytest.raises(TaskModelMismatchError, match="task.max_length=128 exceeds model 'tiny-opt'.s "
                                                     "max_position_embeddings=64"):
        build_task(TaskConfig(max_length=128), "tiny-opt")


def test_word_longer_than_max_length():
    with pytest.raises(TaskModelMismatchError, match="verbalizer word 'terrible' takes 9 tokens .*max_length=8"):
        build_task(TaskConfig(max_length=8), "tiny-opt")


def test_holding_out_every_row_is_an_error(tmp_path):
    with pytest.raises(WorkloadError, match="task.eval_size=2 holds out every row"):
        build_task(TaskConfig(data_path=write_jsonl(tmp_path / "two.jsonl", GOOD), eval_size=2), "tiny-opt")


def test_tokenizer_model_requires_tokenizer_files():
    with pytest.raises(ModelNotFoundError, match="task.tokenizer is 'model' but a model built from a named config has "
                                                 "no tokenizer files"):
        build_task(TaskConfig(tokenizer="model"), "tiny-opt")


@pytest.mark.parametrize("fields, message", [
    ({"epochs": 3}, "Extra inputs are not permitted"),
    ({"template": "It was"}, "must contain the placeholder {text} exactly once"),
    ({"template": "{text} {label}"}, "no other placeholders"),
    ({"verbalizer": {0: "great"}}, "at least two labels"),
    ({"verbalizer": {1: "great", "1": "good"}}, "collide once written as text"),
    ({"verbalizer": {0: "great", 1: "great"}}, "verbalizer words must differ"),
    ({"batch_size": 0}, "batch_size"),
])
def test_task_config_rejects_bad_fields(fields, message):
    with pytest.raises(ValidationError, match=message.replace("{", r"\{").replace("}", r"\}")):
        TaskConfig(**fields)
