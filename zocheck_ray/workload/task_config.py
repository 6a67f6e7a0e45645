"""`TaskConfig`: what a fine-tuning task reads, how it prompts, samples and evaluates.

    TaskConfig()                                   # SST-2 style on the shipped data
    TaskConfig(kind="lm", data_path="notes.jsonl", text_field="text")
    TaskConfig(kind="classification", data_path="reviews.csv", verbalizer={"neg": "", "pos": ""})
"""

from __future__ import annotations

import string
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from zocheck_ray.workload.tokenization import TokenizerChoice

DataFormat = Literal["auto", "jsonl", "csv", "parquet", "dataset"]
TaskKind = Literal["sst2", "lm", "classification", "rte", "cb", "boolq", "wsc", "wic", "multirc", "copa", "squad"]
MEZO_KINDS = ("rte", "cb", "boolq", "wsc", "wic", "multirc", "copa", "squad")
"""MeZO's tasks beyond SST-2 (`rows.py`, `prompts.py`)."""


class TaskConfig(BaseModel):
    """A ZO fine-tuning task: data, prompt, sampling and evaluation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: TaskKind = "sst2"
    """`sst2`: a causal LM scores each verbalizer word after the prompt; `lm`: next-token loss; `classification`:
    a classification head; MeZO's `rte`, `cb`, `boolq`, `wsc`, `wic`, `multirc`, `copa` and `squad`."""
    data_path: str | None = None
    """Training rows: a JSONL, CSV or Parquet file or a `save_to_disk` folder; None: the shipped SST-2 style data."""
    eval_path: str | None = None
    """Held-out rows in their own file; None: the folder's `eval_split`, else `eval_size` rows held out."""
    data_format: DataFormat = "auto"
    """`jsonl`, `csv`, `parquet`, `dataset` (a `save_to_disk` folder), or `auto` (by the suffix)."""
    split: str = "train"
    """The training split of a `save_to_disk` folder holding several (a `DatasetDict`)."""
    eval_split: str = "validation"
    """The held-out split of such a folder."""
    k_shot: int | None = Field(None, ge=1)
    """Our own k-shot (not MeZO's): k training rows per class (`squad`: in all); None: every row."""
    num_train: int | None = Field(None, ge=1)
    """MeZO's sampler: training rows of a permutation seeded by `train_set_seed`."""
    num_dev: int | None = Field(None, ge=1)
    """MeZO's dev rows, evaluated as `dev_<metric>`."""
    num_eval: int | None = Field(None, ge=1)
    """MeZO's held-out rows (None: all)."""
    train_set_seed: int = Field(0, ge=0)
    """MeZO's `train_set_seed`."""
    text_field: str = Field("sentence", min_length=1)
    """The field (JSONL) or column (CSV) holding the text."""
    label_field: str = Field("label", min_length=1)
    """The field or column holding the label (not read by `lm`)."""
    verbalizer: dict[int | str, str] = Field(default_factory=lambda: {0: "terrible", 1: "great"})
    """Label -> word, in class order: `sst2` scores the words; `classification` uses only the keys."""
    template: str = "{text} It was"
    """`sst2` prompt: `{text}` is the row's text; each candidate follows as " <word>"."""
    batch_size: int = Field(16, ge=1)
    """Rows per training step."""
    max_length: int = Field(64, ge=2)
    """Tokens per sequence at most; prompts lose their start, other texts their end."""
    data_seed: int = Field(0, ge=0)
    """The batch of step t is a pure function of (data_seed, t)."""
    eval_size: int = Field(96, ge=1)
    """Held-out rows evaluated by `Task.evaluate` (at most this many from `eval_path`)."""
    eval_interval: int = Field(50, ge=1)
    """Steps between held-out evaluations (the trainer also evaluates at the end)."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Rows per forward pass of a training step, for small devices (None: all at once). The loss sums add up in
    float64, in order, so the projected gradient does not depend on it."""
    shards: int | None = Field(None, ge=1)
    """Data parallel's shards of a step's batch, each one forward pass (or its micro-batches) whose loss sum
    and count add up in shard order in float64: runs with any number of ranks up to `shards` give the same
    bits. None: one shard per rank (`scaling.trainers`)."""
    eval_batch_size: int = Field(64, ge=1)
    """Rows per forward pass during evaluation (memory only)."""
    tokenizer: TokenizerChoice = "auto"
    """`auto`: the model directory's tokenizer if it has one, else byte-level; `model`; `byte`."""

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
        if self.num_train is None and (self.num_dev, self.num_eval) != (None, None):
            raise ValueError("task.num_dev and task.num_eval belong to MeZO's sampler: set task.num_train too")
        if self.num_train is not None and self.k_shot is not None:
            raise ValueError("task.k_shot and task.num_train are two samplers: set one")
        if self.kind == "lm" and self.k_shot is not None:
            raise ValueError("task.k_shot samples k rows per class, and kind 'lm' has no classes; unset k_shot (or "
                             "choose a classification kind)")
        return self

    @property
    def labels(self) -> list[str]:
        """The labels in class order, as text."""
        return [str(k) for k in self.verbalizer]
