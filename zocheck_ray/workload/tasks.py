"""Tasks: the batches, loss and held-out metrics a ZO trainer needs, built before any model.

    task = build_task(TaskConfig(), "tiny-opt")            # every input checked (builder.py)
    model = build_model("tiny-opt")
    opt = ZOOptimizer(trainable_parameters(model), ZOConfig(lr=1e-3))
    for t in range(steps):
        batch = task.batch(t)                              # a pure function of (data_seed, t)
        opt.step(lambda: task.loss(model, batch), seed=step_seed(run_seed, t))
    task.evaluate(model)

Prompt classification scores each candidate by the mean log-probability of its tokens (MeZO's
`train_as_classification`).
"""

from __future__ import annotations

import collections
import math
import re
import string
from abc import ABC, abstractmethod
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from zocheck_ray.workload.data import batch_indices
from zocheck_ray.workload.errors import WorkloadError
from zocheck_ray.workload.examples import MAX_NEW_TOKENS, AnswerExample, PromptExample, TextExample
from zocheck_ray.workload.task_config import TaskConfig
from zocheck_ray.workload.tokenization import TextTokenizer

__all__ = ["Task", "PromptClassificationTask", "PromptLanguageModelTask", "LanguageModelingTask",
           "SequenceClassificationTask", "SquadTask", "TaskConfig", "f1_score", "normalize_answer", "truncate"]

IGNORE = -100
"""Target id that contributes no loss (padding, prompt tokens)."""


def _pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) right-padded to the longest sequence."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, seq in enumerate(seqs):
        ids[r, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[r, :len(seq)] = 1
    return ids, mask


def _target_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at every position with a target, 0 elsewhere, in float32."""
    picked = targets != IGNORE
    out = torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
    rows = logits[picked].float().log_softmax(-1)
    out[picked] = rows.gather(-1, targets[picked].unsqueeze(-1)).squeeze(-1)
    return out


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _to(batch: dict[str, torch.Tensor], device: torch.device | str | None) -> dict[str, torch.Tensor]:
    return batch if device is None else {k: v.to(device) for k, v in batch.items()}


def truncate(ids: list[int], max_length: int, keeps_first: bool) -> list[int]:
    """MeZO's truncation: the first token (a BOS) and the last `max_length - 1`, else the last `max_length`."""
    return ids[:1] + ids[1:][-(max_length - 1):] if keeps_first else ids[-max_length:]


class Task(ABC):
    """What the trainer calls: `batch(step)`, `loss(model, batch)`, `evaluate(model)`."""

    metric: str
    """The key of `evaluate`'s result that tells progress (`accuracy` or `loss`)."""
    higher_is_better: bool

    def __init__(self, config: TaskConfig, tokenizer: TextTokenizer, train: list, held_out: list, dev: list = ()):
        self.config = config
        self.tokenizer = tokenizer
        self.train_examples = train
        self.eval_examples = held_out
        self.dev_examples = list(dev)

    @property
    def n_train(self) -> int:
        return len(self.train_examples)

    @property
    def n_eval(self) -> int:
        return len(self.eval_examples)

    def batch(self, step: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The batch of step `step`, a pure function of (data_seed, step), on `device`."""
        rows = batch_indices(self.config.data_seed, step, self.config.batch_size, self.n_train)
        return _to(self._collate([self.train_examples[i] for i in rows]), device)

    def _micro_batches(self, rows: list[int], device) -> list[dict[str, torch.Tensor]]:
        """The rows' examples in `micro_batch_size` pieces, each collated on its own."""
        size = self.config.micro_batch_size
        return [_to(self._collate([self.train_examples[i] for i in rows[a:a + size]]), device)
                for a in range(0, len(rows), size)]

    def _accumulated(self, model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
        """(sum of the micro-batches' loss sums, sum of their counts), added in order in float64."""
        total = count = 0.0
        for batch in batches:
            s, c = self._loss_sum(model, batch)
            total += float(s)
            count += float(c)
        return total, count

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The scalar training loss of `model` on `batch` (float32)."""
        return self._loss(model, _to(batch, _device_of(model)))

    def closure(self, model: torch.nn.Module, step: int) -> Callable[[], torch.Tensor | float]:
        """`ZOOptimizer.step`'s closure for step `step`."""
        if self.config.micro_batch_size is not None:
            rows = batch_indices(self.config.data_seed, step, self.config.batch_size, self.n_train)
            batches = self._micro_batches(rows, _device_of(model))

            def accumulated() -> float:
                total, count = self._accumulated(model, batches)
                return total / count
            return accumulated
        batch = self.batch(step, _device_of(model))
        return lambda: self._loss(model, batch)

    def batch_slice(self, step: int, rank: int, ranks: int,
                    device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Rank `rank`'s contiguous slice of step `step`'s batch, on `device`."""
        if self.config.batch_size % ranks:
            raise WorkloadError(f"task.batch_size={self.config.batch_size} does not divide among {ranks} ranks")
        rows = batch_indices(self.config.data_seed, step, self.config.batch_size, self.n_train)
        size = len(rows) // ranks
        return _to(self._collate([self.train_examples[i] for i in rows[rank * size:(rank + 1) * size]]), device)

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
        """(summed loss, count) on `batch`: what data-parallel ranks add up in float64."""
        total, count = self._loss_sum(model, _to(batch, _device_of(model)))
        return float(total), float(count)

    def slice_closure(self, model: torch.nn.Module, step: int, rank: int,
                      ranks: int) -> Callable[[], tuple[float, float]]:
        """A data-parallel rank's closure: (loss sum, count) on its slice of step `step`'s batch."""
        if self.config.micro_batch_size is not None:
            if self.config.batch_size % ranks:
                raise WorkloadError(f"task.batch_size={self.config.batch_size} does not divide among {ranks} ranks")
            rows = batch_indices(self.config.data_seed, step, self.config.batch_size, self.n_train)
            size = len(rows) // ranks
            batches = self._micro_batches(rows[rank * size:(rank + 1) * size], _device_of(model))
            return lambda: self._accumulated(model, batches)
        batch = self.batch_slice(step, rank, ranks, _device_of(model))
        return lambda: self.loss_sum(model, batch)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Metrics on the held-out rows, in `eval_batch_size` chunks, and on MeZO's dev rows as `dev_<name>`."""
        metrics = self._metrics(model, self.eval_examples)
        if self.dev_examples:
            metrics.update({f"dev_{k}": v for k, v in self._metrics(model, self.dev_examples).items()})
        return metrics

    def _metrics(self, model: torch.nn.Module, examples: list) -> dict[str, float]:
        device = _device_of(model)
        sums: dict[str, float] = {}
        size = self.config.eval_batch_size
        for start in range(0, len(examples), size):
            batch = _to(self._eval_collate(examples[start:start + size]), device)
            for key, value in self._eval_sums(model, batch).items():
                sums[key] = sums.get(key, 0.0) + value
        return self._finish(sums)

    def summary(self) -> dict:
        """What a progress line or a run summary shows about the task."""
        out = {"kind": self.config.kind, "train_rows": self.n_train, "eval_rows": self.n_eval,
               "metric": self.metric, "tokenizer": self.tokenizer.describe()}
        return out | ({"dev_rows": len(self.dev_examples)} if self.dev_examples else {})

    @abstractmethod
    def _collate(self, examples: list) -> dict[str, torch.Tensor]: ...

    def _eval_collate(self, examples: list) -> dict[str, torch.Tensor]:
        return self._collate(examples)

    @abstractmethod
    def _loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def _loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        # Classification tasks: the mean is over rows.
        return self._loss(model, batch) * batch["labels"].shape[0], batch["labels"].shape[0]

    @abstractmethod
    def _eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]: ...

    @abstractmethod
    def _finish(self, sums: dict[str, float]) -> dict[str, float]: ...


def _classification_finish(sums: dict[str, float]) -> dict[str, float]:
    return {"accuracy": sums["correct"] / sums["rows"], "loss": sums["loss"] / sums["rows"]}


def _option_spans(seqs: list[list[int]], option_lens: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """ids, mask and targets of each sequence's last `option_len` tokens."""
    ids, mask = _pad(seqs, pad_id)
    targets = torch.full(ids.shape, IGNORE, dtype=torch.long)
    for r, (seq, n) in enumerate(zip(seqs, option_lens)):
        a, b = len(seq) - n, len(seq)
        targets[r, a - 1:b - 1] = ids[r, a:b]  # position t predicts token t + 1
    return {"input_ids": ids, "attention_mask": mask, "targets": targets}


class PromptClassificationTask(Task):
    """`sst2` and MeZO's classification tasks: a causal LM scores each candidate after the prompt."""

    metric = "accuracy"
    higher_is_better = True

    def _collate(self, examples: list[PromptExample]) -> dict[str, torch.Tensor]:
        seqs, lens = [], []
        for ex in examples:
            for seq, n in zip(ex.sequences, ex.option_lens):
                seqs.append(truncate(seq, self.config.max_length, self.tokenizer.adds_bos))
                lens.append(n)
        batch = _option_spans(seqs, lens, self.tokenizer.pad_id)
        batch["labels"] = torch.tensor([ex.label for ex in examples], dtype=torch.long)
        return batch

    def scores(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[rows, candidates]: each candidate's mean token log-probability after the prompt."""
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        log_probs = _target_log_probs(logits, batch["targets"])
        counts = (batch["targets"] != IGNORE).sum(-1)
        return (log_probs.sum(-1) / counts).view(batch["labels"].shape[0], -1)

    def _loss(self, model, batch):
        return F.cross_entropy(self.scores(model, batch), batch["labels"])

    def _eval_sums(self, model, batch):
        scores = self.scores(model, batch)
        labels = batch["labels"]
        return {"correct": float((scores.argmax(-1) == labels).sum()), "rows": float(labels.numel()),
                "loss": float(F.cross_entropy(scores, labels, reduction="sum"))}

    _finish = staticmethod(_classification_finish)


class PromptLanguageModelTask(PromptClassificationTask):
    """`copa`, as MeZO's scripts run it: the loss is the gold candidate's tokens' cross-entropy."""

    def _collate(self, examples: list[PromptExample]) -> dict[str, torch.Tensor]:
        seqs = [truncate(ex.sequences[ex.label], self.config.max_length, self.tokenizer.adds_bos) for ex in examples]
        return _option_spans(seqs, [ex.option_lens[ex.label] for ex in examples], self.tokenizer.pad_id)

    def _eval_collate(self, examples: list[PromptExample]) -> dict[str, torch.Tensor]:
        return PromptClassificationTask._collate(self, examples)

    def _cross_entropy(self, model, batch, reduction: str) -> torch.Tensor:
        # MeZO's forward_wrap_with_option_len: one CrossEntropyLoss(ignore_index=-100) over the shifted batch
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"][:, :-1].reshape(-1),
                               ignore_index=IGNORE, reduction=reduction)

    def _loss(self, model, batch):
        return self._cross_entropy(model, batch, "mean")

    def _loss_sum(self, model, batch):
        return self._cross_entropy(model, batch, "sum"), (batch["targets"] != IGNORE).sum()

    def _eval_sums(self, model, batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        log_probs = _target_log_probs(logits, batch["targets"])
        counts = (batch["targets"] != IGNORE).sum(-1)
        labels = batch["labels"]
        scores = (log_probs.sum(-1) / counts).view(labels.shape[0], -1)
        gold = torch.arange(labels.shape[0], device=labels.device) * scores.shape[1] + labels  # the gold rows
        return {"correct": float((scores.argmax(-1) == labels).sum()), "rows": float(labels.numel()),
                "nll": float(-log_probs.sum(-1)[gold].sum()), "tokens": float(counts[gold].sum())}

    def _finish(self, sums):
        return {"accuracy": sums["correct"] / sums["rows"], "loss": sums["nll"] / sums["tokens"]}


class SequenceClassificationTask(Task):
    """`classification`: cross-entropy of a classification head's logits."""

    metric = "accuracy"
    higher_is_better = True

    def _collate(self, examples: list[TextExample]) -> dict[str, torch.Tensor]:
        ids, mask = _pad([ex.ids for ex in examples], self.tokenizer.pad_id)
        return {"input_ids": ids, "attention_mask": mask,
                "labels": torch.tensor([ex.label for ex in examples], dtype=torch.long)}

    def _logits(self, model, batch):
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()

    def _loss(self, model, batch):
        return F.cross_entropy(self._logits(model, batch), batch["labels"])

    def _eval_sums(self, model, batch):
        logits = self._logits(model, batch)
        labels = batch["labels"]
        return {"correct": float((logits.argmax(-1) == labels).sum()), "rows": float(labels.numel()),
                "loss": float(F.cross_entropy(logits, labels, reduction="sum"))}

    _finish = staticmethod(_classification_finish)


class TokenLossTask(Task):
    """A task whose loss is the mean cross-entropy of its `targets` tokens."""

    def _nll(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return -_target_log_probs(logits, batch["targets"]).sum(), (batch["targets"] != IGNORE).sum()

    def _loss(self, model, batch):
        total, count = self._nll(model, batch)
        return total / count

    def _loss_sum(self, model, batch):
        return self._nll(model, batch)

    def _eval_sums(self, model, batch):
        total, count = self._nll(model, batch)
        return {"nll": float(total), "tokens": float(count)}


class LanguageModelingTask(TokenLossTask):
    """`lm`: next-token cross-entropy over each text's tokens (padding excluded)."""

    metric = "loss"
    higher_is_better = False

    def _collate(self, examples: list[TextExample]) -> dict[str, torch.Tensor]:
        ids, mask = _pad([ex.ids for ex in examples], self.tokenizer.pad_id)
        targets = torch.full(ids.shape, IGNORE, dtype=torch.long)
        targets[:, :-1] = torch.where(mask[:, 1:] == 1, ids[:, 1:], IGNORE)
        return {"input_ids": ids, "attention_mask": mask, "targets": targets}

    def _finish(self, sums):
        loss = sums["nll"] / sums["tokens"]
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}


# ---------------------------------------------------------------- SQuAD


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lowercase, punctuation and articles removed, whitespace collapsed."""
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    """SQuAD's token F1 of two answers (after `normalize_answer`)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = collections.Counter(pred) & collections.Counter(ref)
    same = sum(common.values())
    if same == 0:  # both empty too, as MeZO's metrics.py (SQuAD v1.1's script)
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


class SquadTask(TokenLossTask):
    """`squad`: the answer tokens' mean cross-entropy; evaluation decodes greedily (F1, exact match)."""

    metric = "f1"
    higher_is_better = True
    max_answer_tokens = MAX_NEW_TOKENS

    def _collate(self, examples: list[AnswerExample]) -> dict[str, torch.Tensor]:
        room = self.config.max_length - self.max_answer_tokens
        seqs = [truncate(ex.sequence, room, self.tokenizer.adds_bos) for ex in examples]
        return _option_spans(seqs, [ex.answer_len for ex in examples], self.tokenizer.pad_id)

    def _finish(self, sums):
        return {"loss": sums["nll"] / sums["tokens"]}

    @torch.no_grad()
    def answer(self, model: torch.nn.Module, example: AnswerExample) -> str:
        """MeZO's greedy answer: up to `max_answer_tokens`, stopping at the id of "\n" or EOS."""
        device = next(model.parameters()).device
        ids = truncate(example.prompt, self.config.max_length - self.max_answer_tokens, self.tokenizer.adds_bos)
        stop = {self.tokenizer.encode(["\n"])[0][-1], self.tokenizer.eos_id}
        generated: list[int] = []
        for _ in range(min(self.max_answer_tokens, self.config.max_length - len(ids))):
            x = torch.tensor([ids + generated], device=device)
            logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, -1]
            token = int(logits.float().argmax())
            if token in stop:
                break
            generated.append(token)
        return self.tokenizer.decode(generated).strip()

    def _metrics(self, model: torch.nn.Module, examples: list) -> dict[str, float]:
        metrics = super()._metrics(model, examples)  # the gold answers' loss
        f1 = exact = 0.0
        for example in examples:
            prediction = self.answer(model, example)
            f1 += max(f1_score(prediction, gold) for gold in example.answers)
            exact += max(float(normalize_answer(prediction) == normalize_answer(gold)) for gold in example.answers)
        n = max(1, len(examples))
        return {"f1": f1 / n, "exact_match": exact / n, **metrics}
