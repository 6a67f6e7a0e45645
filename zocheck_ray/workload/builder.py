"""`build_task`: the model's fit, then files -> rows -> sample -> render -> examples -> task, each stage once.

    task = build_task(TaskConfig(kind="rte", data_path="rte/", k_shot=16), "tiny-opt")
    task = build_task(TaskConfig(kind="sft", eval_size=4), "tiny-chat", rows=dataset)  # rows handed over (sft/prepare.py)

Every error about the data or the model's fit is raised here, before any model or actor exists.
"""

from __future__ import annotations

from pathlib import Path

from zocheck_ray.workload.data import rows_fingerprint
from zocheck_ray.workload.datafiles import InMemoryRows, Splits, read_splits
from zocheck_ray.workload.errors import TaskModelMismatchError
from zocheck_ray.workload.examples import encode_examples
from zocheck_ray.workload.models import model_config_dict, model_directory, model_kind
from zocheck_ray.workload.prompts import render
from zocheck_ray.workload.rows import check_rows
from zocheck_ray.workload.sampling import sample_with_shortfalls
from zocheck_ray.workload.sft.task import SFTTask
from zocheck_ray.workload.task_config import MEZO_KINDS, TaskConfig
from zocheck_ray.workload.tasks import (
    LanguageModelingTask, PromptClassificationTask, PromptLanguageModelTask, SequenceClassificationTask, SquadTask,
    Task,
)
from zocheck_ray.workload.tokenization import TextTokenizer, hf_tokenizer, load_tokenizer

__all__ = ["build_task", "sft_fingerprint"]

TASKS = {"lm": LanguageModelingTask, "classification": SequenceClassificationTask, "copa": PromptLanguageModelTask,
         "squad": SquadTask, "sft": SFTTask}
"""Else `PromptClassificationTask`."""


def _fitted_tokenizer(config: TaskConfig, name: str, overrides: dict | None,
                      tokenizer: TextTokenizer | None) -> TextTokenizer:
    """The tokenizer, the task checked against model `name`'s config."""
    kind = model_kind(name, overrides)
    hf = model_config_dict(name, overrides)
    if tokenizer is None:
        tokenizer = load_tokenizer(model_directory(name), int(hf["vocab_size"]), config.tokenizer, name)
    arch = ", ".join(hf.get("architectures") or [hf.get("model_type", "?")])
    if config.kind in ("sst2", "lm", "sft", *MEZO_KINDS) and kind != "causal-lm":
        raise TaskModelMismatchError(
            f"task kind {config.kind!r} needs a causal LM, but model {name!r} is an encoder with a classification "
            f"head ({arch}); use task kind 'classification', or a causal LM such as tiny-opt, tiny-llama, tiny-qwen3")
    if config.kind == "sft":
        tokenizer = hf_tokenizer(tokenizer)
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
    return tokenizer


def build_task(config: TaskConfig, model: str, overrides: dict | None = None,
               tokenizer: TextTokenizer | None = None, rows: InMemoryRows | None = None,
               eval_rows: InMemoryRows | None = None) -> Task:
    """The task `config` for `model`, every row, label and the model's fit checked without building the model;
    `tokenizer` replaces `config.tokenizer`'s. Kind `sft` may take `rows` and `eval_rows` in memory instead of
    `task.data_path`."""
    tokenizer = _fitted_tokenizer(config, model, overrides, tokenizer)
    splits = read_splits(config, rows, eval_rows)
    checked = check_rows(config, splits)
    splits, shortfalls = sample_with_shortfalls(config, checked)
    splits = render(config, splits)
    examples = encode_examples(config, tokenizer, splits)
    task = _task(config, tokenizer, checked, splits, examples)
    task.warnings = shortfalls  # what a sampler was asked for beyond the rows: the start line and the summary say it
    return task


def _task(config: TaskConfig, tokenizer: TextTokenizer, checked: Splits, sampled: Splits, examples: Splits) -> Task:
    cls = TASKS.get(config.kind, PromptClassificationTask)
    if cls is not SFTTask:
        return cls(config, tokenizer, *examples)
    rows = [*checked.train, *(checked.held or [])]
    return SFTTask(config, tokenizer, *examples, sft_format=rows[0].format,
                   fingerprint=rows_fingerprint(row.record for row in rows),
                   dropped=sum(map(len, sampled)) - sum(map(len, examples)))


def sft_fingerprint(rows: InMemoryRows | str | Path, text_field: str = "text") -> str:
    """The fingerprint (`data.rows_fingerprint`) of SFT rows as `build_task` reads and checks them; `rows`: a
    `datasets.Dataset`, a list of dicts, or a data file's path."""
    path = str(rows) if isinstance(rows, (str, Path)) else None
    config = TaskConfig(kind="sft", data_path=path, text_field=text_field)
    checked = check_rows(config, read_splits(config, None if path else rows))
    return rows_fingerprint(row.record for row in checked.train)
