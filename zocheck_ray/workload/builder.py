"""`build_task`: read and check a task's rows, its labels and the model's fit, then build the task.

    task = build_task(TaskConfig(kind="rte", data_path="rte/", k_shot=16), "tiny-opt")

Every error about the data, the labels or the model's fit is raised here, before any model is built
or any actor started.
"""

from __future__ import annotations

from zocheck_ray.workload.datafiles import SHIPPED_SST2, Row, has_split, read_rows
from zocheck_ray.workload.errors import DataFormatError, LabelError, TaskModelMismatchError, WorkloadError
from zocheck_ray.workload.mezo_tasks import build_mezo_task
from zocheck_ray.workload.models import model_config_dict, model_directory, model_kind
from zocheck_ray.workload.sampling import sample_rows
from zocheck_ray.workload.task_config import MEZO_KINDS, TaskConfig
from zocheck_ray.workload.tasks import (
    LanguageModelingTask, PromptClassificationTask, PromptExample, SequenceClassificationTask, Task, TextExample,
    candidate_examples, split_rows,
)
from zocheck_ray.workload.tokenization import TextTokenizer, load_tokenizer

__all__ = ["build_task"]


def _class_index(config: TaskConfig, row: Row) -> int:
    labels = config.labels
    try:
        return labels.index(str(row.label))
    except ValueError:
        raise LabelError(row.path, row.line, row.label, labels) from None


def _prompt_examples(config: TaskConfig, tokenizer: TextTokenizer, rows: list[Row]) -> list[PromptExample]:
    words = [" " + word for word in config.verbalizer.values()]
    # MeZO's SST2Template formats sentence.strip(): GLUE's sentences end in a space
    return candidate_examples(config, tokenizer, [config.template.format(text=r.text.strip()) for r in rows],
                              [words] * len(rows), [_class_index(config, r) for r in rows], "verbalizer word")


def _text_examples(config: TaskConfig, tokenizer: TextTokenizer, rows: list[Row], labelled: bool) -> list[TextExample]:
    encoded = tokenizer.encode([r.text for r in rows], max_length=config.max_length)
    examples = []
    for row, ids in zip(rows, encoded):
        if not labelled and len(ids) < 2:
            raise DataFormatError(row.path, row.line, f"the text encodes to {len(ids)} token(s) with "
                                                      f"{tokenizer.describe()}; language modelling needs at least 2")
        examples.append(TextExample(ids, _class_index(config, row) if labelled else -1))
    return examples


def _check_fit(config: TaskConfig, name: str, kind: str, hf: dict, tokenizer: TextTokenizer) -> None:
    arch = ", ".join(hf.get("architectures") or [hf.get("model_type", "?")])
    if config.kind in ("sst2", "lm", *MEZO_KINDS) and kind != "causal-lm":
        raise TaskModelMismatchError(
            f"task kind {config.kind!r} needs a causal LM, but model {name!r} is an encoder with a classification "
            f"head ({arch}); use task kind 'classification', or a causal LM such as tiny-opt, tiny-llama, tiny-qwen3")
    if config.kind == "classification":
        if kind != "sequence-classification":
            raise TaskModelMismatchError(
                f"task kind 'classification' needs a model with a classification head, but model {name!r} is a "
                f"causal LM ({arch}); use task kind 'sst2' to classify with the LM's verbalizer scores, or an "
                "encoder such as tiny-bert or minilm")
        n_labels = len(hf.get("id2label") or {}) or 2
        if n_labels != len(config.verbalizer):
            raise TaskModelMismatchError(
                f"model {name!r} has {n_labels} output classes but task.verbalizer has {len(config.verbalizer)} "
                f"labels {config.labels}; build the model with overrides={{'num_labels': {len(config.verbalizer)}}}")
    vocab = int(hf["vocab_size"])
    if tokenizer.vocab_size > vocab:
        raise TaskModelMismatchError(f"the tokenizer ({tokenizer.describe()}) has {tokenizer.vocab_size} ids but "
                                     f"model {name!r} embeds only vocab_size={vocab}; use the model's own tokenizer")
    positions = hf.get("max_position_embeddings")
    if positions is not None and config.max_length > int(positions):
        raise TaskModelMismatchError(f"task.max_length={config.max_length} exceeds model {name!r}'s "
                                     f"max_position_embeddings={positions}; lower task.max_length")


def build_task(config: TaskConfig, model: str, overrides: dict | None = None,
               tokenizer: TextTokenizer | None = None) -> Task:
    """The task `config` for model `model` (a name `build_model` accepts, with the same `overrides`), every row,
    label and the model's fit checked without building the model; `tokenizer` replaces `config.tokenizer`'s."""
    kind = model_kind(model, overrides)
    hf = model_config_dict(model, overrides)
    if tokenizer is None:
        tokenizer = load_tokenizer(model_directory(model), int(hf["vocab_size"]), config.tokenizer)
    _check_fit(config, model, kind, hf, tokenizer)

    if config.kind in MEZO_KINDS:
        return build_mezo_task(config, tokenizer)
    label_field = None if config.kind == "lm" else config.label_field
    path = config.data_path or SHIPPED_SST2
    rows = read_rows(path, config.text_field, label_field, config.data_format, config.split)
    if config.eval_path is None and has_split(path, config.eval_split, config.data_format):
        train = rows
        held_out = read_rows(path, config.text_field, label_field, config.data_format, config.eval_split)
    elif config.eval_path is None:
        if config.num_train is not None:
            raise WorkloadError("MeZO's sampler (task.num_train) draws held-out rows from a validation split: give "
                                "task.eval_path, or a save_to_disk folder with task.eval_split")
        train, held_out = split_rows(rows, config.eval_size)
    else:
        train = rows
        held_out = read_rows(config.eval_path, config.text_field, label_field, config.data_format, config.eval_split)
    train, dev, held_out = sample_rows(config, train, held_out, lambda r: str(r.label),
                                       lambda r: {"text": r.text, "label": r.label})

    if config.kind == "sst2":
        return PromptClassificationTask(config, tokenizer, _prompt_examples(config, tokenizer, train),
                                        _prompt_examples(config, tokenizer, held_out),
                                        _prompt_examples(config, tokenizer, dev))
    labelled = config.kind == "classification"
    cls = SequenceClassificationTask if labelled else LanguageModelingTask
    return cls(config, tokenizer, _text_examples(config, tokenizer, train, labelled),
               _text_examples(config, tokenizer, held_out, labelled), _text_examples(config, tokenizer, dev, labelled))
