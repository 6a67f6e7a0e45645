"""`TaskConfig`: what a fine-tuning task reads, how it prompts, samples and evaluates.

    TaskConfig()                                   # SST-2 style on the shipped data
    TaskConfig(kind="lm", data_path="notes.jsonl", text_field="text")
    TaskConfig(kind="classification", data_path="reviews.csv", verbalizer={"neg": "", "pos": ""})
    TaskConfig(kind="sft", data_path="chats.jsonl", assistant_only_loss=True)   # TRL's SFT formats (sft.py)
"""

from __future__ import annotations

import string
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from zocheck_ray.workload.tokenization import TokenizerChoice

DataFormat = Literal["auto", "jsonl", "csv", "parquet", "dataset"]
TaskKind = Literal["sst2", "lm", "classification", "rte", "cb", "boolq", "wsc", "wic", "multirc", "copa", "squad",
                   "sft"]
MEZO_KINDS = ("rte", "cb", "boolq", "wsc", "wic", "multirc", "copa", "squad")
"""MeZO's tasks beyond SST-2 (`rows.py`, `prompts.py`)."""
SFT_DEFAULTS = {"max_length": 1024, "text_field": "text"}
"""Where kind `sft` follows TRL's `SFTConfig` defaults rather than ours."""
SFT_FIELDS = ("completion_only_loss", "assistant_only_loss", "truncation_mode", "eval_generations", "max_new_tokens")
"""Fields only kind `sft` reads."""


class TaskConfig(BaseModel):
    """A ZO fine-tuning task: data, prompt, sampling and evaluation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: TaskKind = "sst2"
    """`sst2`: a causal LM scores each verbalizer word after the prompt; `lm`: next-token loss; `classification`:
    a classification head; MeZO's `rte`, `cb`, `boolq`, `wsc`, `wic`, `multirc`, `copa` and `squad`; `sft`:
    supervised fine-tuning on TRL's four dataset formats, tokenized as TRL's `SFTTrainer` does (docs/sft.md)."""
    data_path: str | None = None
    """Training rows: a JSONL, CSV or Parquet file or a `save_to_disk` folder; None: the shipped SST-2 style data
    (kind `sft`: the shipped chats)."""
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
    """The field (JSONL) or column (CSV) holding the text; kind `sft`: TRL's `dataset_text_field` of language
    modelling rows, `text` by default."""
    label_field: str = Field("label", min_length=1)
    """The field or column holding the label (not read by `lm`)."""
    verbalizer: dict[int | str, str] = Field(default_factory=lambda: {0: "terrible", 1: "great"})
    """Label -> word, in class order: `sst2` scores the words; `classification` uses only the keys."""
    template: str = "{text} It was"
    """`sst2` prompt: `{text}` is the row's text; each candidate follows as " <word>"."""
    batch_size: int = Field(16, ge=1)
    """Rows per training step."""
    max_length: int = Field(64, ge=2)
    """Tokens per sequence at most; prompts lose their start, other texts their end. Kind `sft`: TRL's
    `max_length`, 1024 by default, cut as `truncation_mode` says."""
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
    """Data parallel's shards of a step's batch, whose loss sums add up in shard order in float64, so any number
    of ranks up to `shards` gives the same bits; None: one shard per rank."""
    eval_batch_size: int = Field(64, ge=1)
    """Rows per forward pass during evaluation (memory only)."""
    tokenizer: TokenizerChoice = "auto"
    """`auto`: the model directory's own tokenizer (a directory without one is refused), byte-level for a model built
    from config; `model`: the directory's, required; `byte`: byte-level ids, whatever the model."""
    completion_only_loss: bool | None = None
    """Kind `sft`, TRL's `completion_only_loss`: train on the completion of prompt-completion rows only; None:
    on for prompt-completion rows (TRL's default)."""
    assistant_only_loss: bool = False
    """Kind `sft`, TRL's `assistant_only_loss`: train on the assistant's tokens of conversational rows only (the
    chat template's `{% generation %}` span)."""
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"
    """Kind `sft`, TRL's `truncation_mode`: a sequence over `max_length` keeps its first or its last tokens."""
    eval_generations: int = Field(3, ge=0)
    """Kind `sft`: greedy generations from the first held-out prompts, for the run's log at each evaluation."""
    max_new_tokens: int = Field(32, ge=1)
    """Kind `sft`: tokens each of those generations adds at most (fewer at EOS or a turn's end)."""

    @model_validator(mode="before")
    @classmethod
    def _sft_defaults(cls, data):
        if isinstance(data, dict) and data.get("kind") == "sft":
            return {**SFT_DEFAULTS, **data}
        return data

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
        if self.kind in ("lm", "sft") and self.k_shot is not None:
            raise ValueError(f"task.k_shot samples k rows per class, and kind {self.kind!r} has no classes; unset "
                             "k_shot (or choose a classification kind)")
        return self

    @model_validator(mode="after")
    def _sft_fields(self) -> "TaskConfig":
        # by value, not by what was given: a dumped config reloads with every field given
        given = [f"task.{name}={getattr(self, name)!r}" for name in SFT_FIELDS
                 if getattr(self, name) != type(self).model_fields[name].default]
        if self.kind != "sft" and given:
            raise ValueError(f"{', '.join(given)}: settings of kind 'sft' (TRL's), which kind {self.kind!r} does not "
                             "read; leave them at their defaults or set task.kind to 'sft'")
        return self

    @property
    def labels(self) -> list[str]:
        """The labels in class order, as text."""
        return [str(k) for k in self.verbalizer]
