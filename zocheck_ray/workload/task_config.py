"""`TaskConfig`: what a fine-tuning task reads, how it prompts, samples and evaluates.

    TaskConfig()                                   # SST-2 style on the shipped data
    TaskConfig(kind="lm", data_path="notes.jsonl", text_field="text")
    TaskConfig(kind="classification", data_path="reviews.csv", verbalizer={"neg": "", "pos": ""})
"""

from __future__ import annotations

import string
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from zocheck_ray.workload.datafiles import DataFormat
from zocheck_ray.workload.tokenization import TokenizerChoice

TaskKind = Literal["sst2", "lm", "classification", "rte", "cb", "boolq", "wsc", "wic", "multirc", "copa", "squad"]
MEZO_KINDS = ("rte", "cb", "boolq", "wsc", "wic", "multirc", "copa", "squad")
"""MeZO's tasks beyond SST-2: their fields, prompt templates and verbalizers are MeZO's (`workload/mezo_tasks.py`)."""


class TaskConfig(BaseModel):
    """A ZO fine-tuning task: data, prompt, sampling and evaluation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: TaskKind = "sst2"
    """`sst2`: a causal LM scores each verbalizer word after the prompt (MeZO's prompt-based
    classification); `lm`: next-token loss on the text; `classification`: an encoder's
    classification head on the text; MeZO's `rte`, `cb`, `boolq`, `wsc`, `wic`, `multirc`, `copa`
    (prompt-based classification with MeZO's templates and verbalizers, accuracy) and `squad`
    (the answer's tokens after MeZO's prompt; F1 and exact match of greedy answers), read from the
    SuperGLUE / SQuAD fields of local files."""
    data_path: str | None = None
    """Training rows: a JSONL, CSV or Parquet file, or a folder written by `datasets`' `save_to_disk`;
    None uses the shipped SST-2 style dataset (`sst2`, `lm`, `classification` only)."""
    eval_path: str | None = None
    """Held-out rows in their own file (or folder); None takes the `eval_split` of a `save_to_disk` folder that
    has one, else holds out `eval_size` rows of `data_path` (see `split_rows`)."""
    data_format: DataFormat = "auto"
    """`jsonl`, `csv`, `parquet`, `dataset` (a `save_to_disk` folder), or `auto` (by the suffix; a folder is a
    `dataset`)."""
    split: str = "train"
    """The training split of a `save_to_disk` folder holding several (a `DatasetDict`)."""
    eval_split: str = "validation"
    """The held-out split of such a folder, used when `eval_path` is None and the folder has it."""
    k_shot: int | None = Field(None, ge=1)
    """MeZO's k-shot sampling: train on k examples per class (`squad`: k in all), drawn with `data_seed`
    (e.g. 16 or 512); None trains on every row."""
    text_field: str = Field("sentence", min_length=1)
    """The field (JSONL) or column (CSV) holding the text."""
    label_field: str = Field("label", min_length=1)
    """The field or column holding the label (not read by `lm`)."""
    verbalizer: dict[int | str, str] = Field(default_factory=lambda: {0: "terrible", 1: "great"})
    """Label -> word, in class order: the labels a row may carry. `sst2` scores the words;
    `classification` uses only the keys (class i is the i-th key)."""
    template: str = "{text} It was"
    """`sst2` prompt; `{text}` is replaced by the row's text and each candidate is
    appended as " <word>" (MeZO's SST-2 template for causal LMs)."""
    batch_size: int = Field(16, ge=1)
    """Rows per training step."""
    max_length: int = Field(64, ge=2)
    """Tokens per sequence at most (prompt and word for `sst2`); longer prompts lose their start,
    longer `lm`/`classification` texts their end."""
    data_seed: int = Field(0, ge=0)
    """The batch of step t is a pure function of (data_seed, t)."""
    eval_size: int = Field(96, ge=1)
    """Held-out rows evaluated by `Task.evaluate` (at most this many from `eval_path`)."""
    eval_interval: int = Field(50, ge=1)
    """Steps between held-out evaluations in the progress output (the trainer also evaluates at the end)."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Gradient accumulation for small devices: rows per forward pass of a training step (None: the whole
    batch, or a data-parallel rank's slice, at once). The step's loss at each perturbation is then the
    sum of the micro-batches' loss sums over the sum of their counts, added in order in float64, so the
    same step gives the same projected gradient on every device and after every recovery."""
    eval_batch_size: int = Field(64, ge=1)
    """Rows per forward pass during evaluation (memory only; the metrics do not depend on it)."""
    tokenizer: TokenizerChoice = "auto"
    """`auto`: the model directory's tokenizer if it has one, else byte-level; `model`: require
    the directory's; `byte`: byte-level ids folded into the model's vocabulary."""

    @field_validator("template")
    @classmethod
    def _template(cls, value: str) -> str:
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(value) if f is not None]
        except ValueError as exc:
            raise ValueError(f"template {value!r} is not a valid format string ({exc}); escape braces as {{{{ }}}}")
        if fields != ["text"]:
            raise ValueError(f"template {value!r} must contain the placeholder {{text}} exactly once and no other "
                             f"placeholders (found {fields})")
        return value

    @field_validator("verbalizer")
    @classmethod
    def _verbalizer(cls, value: dict[int | str, str]) -> dict[int | str, str]:
        if len(value) < 2:
            raise ValueError(f"verbalizer needs at least two labels, got {value}")
        keys = [str(k) for k in value]
        if len(set(keys)) != len(keys):
            raise ValueError(f"verbalizer labels {list(value)} collide once written as text (CSV labels are text)")
        return value

    @model_validator(mode="after")
    def _words(self) -> "TaskConfig":
        if self.kind == "sst2":
            words = list(self.verbalizer.values())
            if any(not w.strip() for w in words):
                raise ValueError(f"verbalizer words must be non-empty for kind 'sst2', got {self.verbalizer}")
            if len(set(words)) != len(words):
                raise ValueError(f"verbalizer words must differ for kind 'sst2', got {self.verbalizer}")
        return self

    @model_validator(mode="after")
    def _mezo_data(self) -> "TaskConfig":
        if self.kind in MEZO_KINDS and self.data_path is None:
            raise ValueError(f"task kind {self.kind!r} reads its rows from task.data_path (JSONL, Parquet or a "
                             "save_to_disk folder with MeZO's fields); nothing is downloaded")
        if self.kind == "lm" and self.k_shot is not None:
            raise ValueError("task.k_shot samples k rows per class, and kind 'lm' has no classes; unset k_shot (or "
                             "choose a classification kind)")
        return self

    @property
    def labels(self) -> list[str]:
        """The labels in class order, as text (how rows are matched to classes)."""
        return [str(k) for k in self.verbalizer]
