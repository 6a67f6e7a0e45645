"""Your own collator and loss: `transformers.Trainer`'s data path as a task (what `ZOTrainer` trains with them).

    task = build_custom_task(TaskConfig(kind="sft"), rows, eval_rows, tokenizer=tok, compute_loss_func=my_loss)

Rows in TRL's SFT formats reach the collator tokenized as kind `sft` does, as `{"input_ids", "labels"}`; other
rows as they are. The batch of step t is `data_collator` over the rows of `batch_indices(data_seed, t)`, so it is
a pure function of (data_seed, t). Its loss is `compute_loss_func` as `Trainer.compute_loss` calls it, or the
model's own `loss`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Callable, Mapping, Sequence

import torch

from zocheck_ray.workload.errors import WorkloadError
from zocheck_ray.workload.model_init import ModelInit, function_name
from zocheck_ray.workload.sampling import hold_out, row_rank
from zocheck_ray.workload.task_config import TaskConfig
from zocheck_ray.workload.tasks import IGNORE, Task

SFT_COLUMNS = (("messages",), ("prompt", "completion"))
"""Besides `task.text_field`: the columns that make a row one of TRL's SFT formats."""


class DatasetFeatures:
    """The tokenizer stand-in of rows that arrive as model inputs (no text to encode)."""

    pad_id = 0
    vocab_size = 0
    adds_bos = False
    eos_id = None

    def describe(self) -> str:
        return "the dataset's own features"


def is_sft_row(row: Mapping, text_field: str) -> bool:
    return any(all(row.get(c) is not None for c in columns) for columns in ((text_field,), *SFT_COLUMNS))


def rows_fingerprint(rows: Sequence[Mapping], source: str) -> str:
    """SHA-256 of the rows' canonical JSON, in order; a value JSON cannot hold is refused, naming the row."""
    digest = hashlib.sha256()
    for i, row in enumerate(rows):
        try:
            line = json.dumps(_plain(row), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise WorkloadError(f"{source} row {i}: {exc}; rows must hold numbers, strings, lists and dicts "
                                "(a datasets.Dataset's rows do)") from None
        digest.update(line.encode() + b"\n")
    return digest.hexdigest()


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):  # a NumPy array or a tensor
        return value.tolist()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class CollatorTask(Task):
    """A task over the dataset's rows with the user's collator and loss; held-out loss token-weighted."""

    metric = "loss"
    higher_is_better = False

    def __init__(self, config: TaskConfig, tokenizer, train: list, held_out: list, *,
                 collate: Callable[[list], Mapping], compute_loss: Callable | None, fingerprint: str,
                 collator_name: str):
        super().__init__(config, tokenizer, train, held_out)
        self.collate, self.compute_loss, self.fingerprint = collate, compute_loss, fingerprint
        self.collator_name = collator_name
        self._shifts: bool | None = None

    def _collate(self, examples: list) -> dict[str, torch.Tensor]:
        try:
            batch = self.collate(examples)
        except Exception as exc:
            raise WorkloadError(f"data_collator {self.collator_name} raised {type(exc).__name__}: {exc}; rows of "
                                "different lengths need a padding collator (give processing_class, or your own "
                                "data_collator)") from exc
        if not isinstance(batch, Mapping) or not all(isinstance(v, torch.Tensor) for v in batch.values()):
            got = type(batch).__name__ if not isinstance(batch, Mapping) else \
                ", ".join(f"{k}: {type(v).__name__}" for k, v in batch.items() if not isinstance(v, torch.Tensor))
            raise WorkloadError(f"data_collator {self.collator_name} must return a dict of tensors (the model's "
                                f"inputs), got {got}")
        return dict(batch)

    def _forward(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, float | None]:
        """(the batch's loss, the items it is a mean over: the trained tokens, as `Trainer` counts them)."""
        inputs = dict(batch)
        labels = inputs.pop("labels", None) if self.compute_loss is not None else inputs.get("labels")
        items = None if labels is None else float((labels[..., 1:] if self._shifts_labels(model) else labels)
                                                  .ne(IGNORE).sum())
        outputs = model(**inputs)
        if self.compute_loss is not None:
            who = f"compute_loss_func {function_name(self.compute_loss)}"
            try:
                loss = self.compute_loss(outputs, labels, num_items_in_batch=items)
            except Exception as exc:
                raise WorkloadError(f"{who} raised {type(exc).__name__}: {exc}") from exc
        else:
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs[0]
            who = f"model {type(model).__name__}"
            if loss is None:
                raise WorkloadError(f"{who} returned no loss: its inputs ({', '.join(inputs)}) hold no labels; give "
                                    "rows or a data_collator with labels, or a compute_loss_func")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise WorkloadError(f"{who} returned a loss of shape {shape}: it must return one scalar tensor")
        if not math.isfinite(float(loss.detach())):
            raise WorkloadError(f"{who} returned a non-finite loss ({float(loss.detach())}): a zeroth-order step needs a finite "
                                "loss at +eps and -eps")
        return loss.reshape(()), items

    def _shifts_labels(self, model: torch.nn.Module) -> bool:
        """Whether the model's loss shifts labels (a causal LM), so position 0 is never a target (`Trainer`'s count)."""
        if self._shifts is None:
            from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            self._shifts = LOSS_MAPPING.get(getattr(base, "loss_type", None)) is ForCausalLMLoss and not getattr(
                getattr(base, "config", None), "is_encoder_decoder", False)
        return self._shifts

    def _loss(self, model, batch):
        return self._forward(model, batch)[0]

    def _loss_sum(self, model, batch):
        loss, items = self._forward(model, batch)
        weight = items if items else float(len(next(iter(batch.values()))))
        return loss.double() * weight, weight

    def _eval_sums(self, model, batch):
        total, weight = self._loss_sum(model, batch)
        return {"loss_sum": float(total), "items": weight}

    def _finish(self, sums):
        loss = sums["loss_sum"] / sums["items"]
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))} if self._shifts else {"loss": loss}

    def summary(self) -> dict:
        return super().summary() | {"collator": self.collator_name, "fingerprint": self.fingerprint[:16],
                                    "loss": function_name(self.compute_loss) if self.compute_loss else "the model's"}


def _pad_collate(pad_id: int) -> Callable[[list], dict]:
    """TRL's SFT collator on `{"input_ids", "labels"}` rows: right padding, -100 labels on the padding."""

    def collate(rows: list) -> dict:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n], mask[i, :n], labels[i, :n] = torch.tensor(r["input_ids"]), 1, torch.tensor(r["labels"])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return collate


def _sft_features(config: TaskConfig, tokenizer, rows, source: str) -> list[dict]:
    from zocheck_ray.workload.sft.prepare import encode_rows, hf_tokenizer, resolve_settings
    from zocheck_ray.workload.sft.rows import sft_rows

    checked = sft_rows(rows, config.text_field, source)
    tokenizer = hf_tokenizer(tokenizer)
    examples, _ = encode_rows(config, tokenizer, checked, resolve_settings(config, tokenizer, checked[0]))
    return [{"input_ids": ex.input_ids, "labels": [i if m else IGNORE for i, m in zip(ex.input_ids, ex.loss_mask)]}
            for ex in examples]


def build_custom_task(config: TaskConfig, rows: Sequence[Mapping], eval_rows: Sequence[Mapping] | None = None, *,
                      tokenizer=None, data_collator: Callable | None = None,
                      compute_loss_func: Callable | None = None) -> CollatorTask:
    """The task of `rows` (a `datasets.Dataset` or a list of dicts) with the user's collator and loss; held-out rows
    from `eval_rows`, else `task.eval_size` rows held out by `row_rank(data_seed, row)`."""
    for name, fn in (("data_collator", data_collator), ("compute_loss_func", compute_loss_func)):
        if fn is not None and not callable(fn):
            raise WorkloadError(f"{name} must be a function, got {type(fn).__name__}")
    if len(rows) == 0:
        raise WorkloadError("the train_dataset handed over holds no rows")
    train = [dict(r) for r in rows]
    held = None if eval_rows is None else [dict(r) for r in eval_rows]
    fingerprint = rows_fingerprint(train if held is None else [*train, *held], "train_dataset")
    if held is None:
        if config.eval_size >= len(train):
            raise WorkloadError(f"task.eval_size={config.eval_size} holds out every row of the train_dataset "
                                f"({len(train)} rows); give an eval_dataset or lower task.eval_size")
        train, held = hold_out(train, config.eval_size, lambda row: row_rank(config.data_seed, _plain(row)))
    held = held[:config.eval_size]
    sft = is_sft_row(train[0], config.text_field)
    if sft:
        if tokenizer is None:
            raise WorkloadError("the train_dataset's rows are SFT rows (text, messages or prompt/completion): give "
                                "processing_class (the tokenizer), or a model whose directory holds one")
        train = _sft_features(config, tokenizer, train, "train_dataset")
        held = _sft_features(config, tokenizer, held, "eval_dataset")
    if data_collator is not None:
        collate, collator_name = data_collator, function_name(data_collator)
    elif sft:
        collate, collator_name = _pad_collate(tokenizer.pad_id), "TRL's SFT padding"
    else:
        from transformers import DataCollatorWithPadding, default_data_collator

        hf = getattr(tokenizer, "tokenizer", tokenizer)
        collate = DataCollatorWithPadding(hf) if hf is not None else default_data_collator
        collator_name = type(collate).__name__ if hf is not None else "default_data_collator"
    if not held:
        raise WorkloadError("no held-out rows: give an eval_dataset, or lower task.eval_size below the rows' count")
    task = CollatorTask(config, tokenizer if tokenizer is not None else DatasetFeatures(), train, held,
                        collate=collate, compute_loss=compute_loss_func, fingerprint=fingerprint,
                        collator_name=collator_name)
    task.batch(0)  # the collator on a first batch, here: before any actor starts
    return task


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a run trains on beyond its job's files: rows and functions handed over in Python (`ZOTrainer`'s)."""

    train_rows: Sequence[Mapping] | None = None
    """A `datasets.Dataset` or a list of dicts (None: `task.data_path`)."""
    eval_rows: Sequence[Mapping] | None = None
    tokenizer: Any = None
    """A Hugging Face tokenizer (`processing_class`); None: the model's own."""
    data_collator: Callable[[list], Mapping] | None = None
    compute_loss_func: Callable | None = None
    model_init: ModelInit | None = None
    """The job's `model` as a function each trainer calls (`model_init.py`)."""

    @property
    def custom(self) -> bool:
        """Whether the user's collator or loss take part (else the task kind's own)."""
        return self.data_collator is not None or self.compute_loss_func is not None

    def build(self, config: TaskConfig, model: str) -> Task:
        """The task: kind `sft` on TRL's rows, else a `CollatorTask` with the user's collator and loss (or
        `Trainer`'s defaults)."""
        from zocheck_ray.workload.builder import build_task
        from zocheck_ray.workload.tokenization import HFTokenizer

        tokenizer = self.tokenizer
        if tokenizer is not None and not hasattr(tokenizer, "describe"):
            tokenizer = HFTokenizer(None, tokenizer=tokenizer, name="(processing_class)")
        features = self.train_rows is not None and len(self.train_rows) > 0 and isinstance(self.train_rows[0], Mapping) \
            and not is_sft_row(self.train_rows[0], config.text_field)
        if tokenizer is None and self.model_init is not None and self.train_rows is not None and not features:
            raise WorkloadError(f"the train_dataset's rows are SFT rows, and model_init {self.model_init.function} "
                                "brings no tokenizer: give processing_class (the model's tokenizer)")
        if not self.custom and not features:  # TRL's rows, tokenized and trained on as kind `sft`
            return build_task(config, model, tokenizer=tokenizer, rows=self.train_rows, eval_rows=self.eval_rows)
        if self.train_rows is None:
            raise WorkloadError("a data_collator or compute_loss_func trains on rows handed over: give a "
                                "train_dataset")
        if tokenizer is None:
            tokenizer = _model_tokenizer(config, model)
        return build_custom_task(config, self.train_rows, self.eval_rows, tokenizer=tokenizer,
                                 data_collator=self.data_collator, compute_loss_func=self.compute_loss_func)


def _model_tokenizer(config: TaskConfig, model: str):
    """The model's own Hugging Face tokenizer, or None where it has none (byte-level)."""
    from zocheck_ray.workload.models import model_config_dict
    from zocheck_ray.workload.names import model_directory
    from zocheck_ray.workload.tokenization import HFTokenizer, load_tokenizer

    tokenizer = load_tokenizer(model_directory(model), int(model_config_dict(model)["vocab_size"]), config.tokenizer,
                               model)
    return tokenizer if isinstance(tokenizer, HFTokenizer) else None
