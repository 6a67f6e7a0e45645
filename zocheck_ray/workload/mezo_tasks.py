"""MeZO's tasks from local files: RTE, CB, BoolQ, WSC, WiC, MultiRC, COPA (prompt-based classification)
and SQuAD (answer generation), with MeZO's prompt templates, verbalizers, k-shot sampling and metrics.

    task = build_task(TaskConfig(kind="rte", data_path="rte/", k_shot=16, batch_size=16), "tiny-opt")

Rows carry the SuperGLUE and SQuAD fields as `datasets` names them, read from local files; nothing is
downloaded. Candidates are scored as in `PromptClassificationTask`, COPA trains on its gold candidate.
SQuAD trains on " <answer>\n" after MeZO's prompt and is evaluated by MeZO's greedy decoding, F1 and
exact match. Our k-shot keeps, per class, the k rows of smallest SHA-256 of (data_seed, row).
"""

from __future__ import annotations

import collections
import re
import string
from dataclasses import dataclass
from pathlib import Path

import torch

from zocheck_ray.workload.datafiles import data_format, has_split, read_records
from zocheck_ray.workload.errors import DataFormatError, LabelError, WorkloadError
from zocheck_ray.workload.sampling import row_rank, sample_rows
from zocheck_ray.workload.task_config import TaskConfig
from zocheck_ray.workload.tasks import (
    PromptClassificationTask, PromptLanguageModelTask, TokenLossTask, _option_spans, candidate_examples, mezo_encode,
    truncate,
)
from zocheck_ray.workload.tokenization import TextTokenizer

YES_NO = ("Yes", "No")


@dataclass(frozen=True)
class Rendered:
    """A row as MeZO prompts it: the prompt, each candidate's text after it (class order), the label."""

    prompt: str
    options: tuple[str, ...]
    label: int


def _field(record: dict, name: str, where: tuple[str, int]) -> str:
    if name not in record:
        raise DataFormatError(*where, f"missing field {name!r} (the row has {sorted(record)}); MeZO's task reads "
                                      "the SuperGLUE/SQuAD field names")
    value = record[name]
    if not isinstance(value, str) or not value.strip():
        raise DataFormatError(*where, f"field {name!r} must be a non-empty string, got {value!r}")
    return value


def _label(record: dict, names: dict, where: tuple[str, int], field: str = "label") -> int:
    """The class index of the row's `field` (an index, a boolean for yes/no tasks, or the dataset's name)."""
    value = record.get(field)
    count = len(set(names.values()))
    if isinstance(value, bool) and count == 2:
        return names[value]
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < count:
        return value
    if isinstance(value, str) and value.strip().lower() in names:
        return names[value.strip().lower()]
    raise LabelError(*where, value, [str(k) for k in names])


_ENTAILMENT = {"entailment": 0, "not_entailment": 1, 0: 0, 1: 1}
_CB = {"entailment": 0, "contradiction": 1, "neutral": 2, 0: 0, 1: 1, 2: 2}
_BINARY = {False: 0, True: 1, "false": 0, "true": 1, 0: 0, 1: 1}


def _rte(r, w):
    premise, hypothesis = _field(r, "premise", w), _field(r, "hypothesis", w)
    return Rendered(f"{premise}\nDoes this mean that \"{hypothesis}\" is true? Yes or No?\n", YES_NO,
                    _label(r, _ENTAILMENT, w))


def _cb(r, w):
    premise, hypothesis = _field(r, "premise", w), _field(r, "hypothesis", w)
    return Rendered(f"Suppose {premise} Can we infer that \"{hypothesis}\"? Yes, No, or Maybe?\n",
                    (*YES_NO, "Maybe"), _label(r, _CB, w))


def _boolq(r, w):
    # MeZO's default BoolQ template (its version 2); SuperGLUE's has `label`, the `boolq` dataset `answer`.
    passage, question = _field(r, "passage", w), _field(r, "question", w)
    if not question.endswith("?"):
        question += "?"
    question = question[0].upper() + question[1:]
    field = "label" if "label" in r or "answer" not in r else "answer"
    return Rendered(f"{passage} {question}\n", YES_NO, 1 - _label(r, _BINARY, w, field))


def _wsc(r, w):
    text, span1, span2 = _field(r, "text", w), _field(r, "span1_text", w), _field(r, "span2_text", w)
    return Rendered(f"{text}\nIn the previous sentence, does the pronoun \"{span2.lower()}\" refer to {span1}? "
                    "Yes or No?\n", ("No", "Yes"), _label(r, _BINARY, w))


def _wic(r, w):
    word, first, second = _field(r, "word", w), _field(r, "sentence1", w), _field(r, "sentence2", w)
    return Rendered(f"Does the word \"{word}\" have the same meaning in these two sentences? Yes, No?\n"
                    f"{first}\n{second}\n", ("No", "Yes"), _label(r, _BINARY, w))


def _multirc(r, w):
    paragraph, question, answer = _field(r, "paragraph", w), _field(r, "question", w), _field(r, "answer", w)
    return Rendered(f"{paragraph}\nQuestion: {question}\nI found this answer \"{answer}\". Is that correct? "
                    "Yes or No?\n", ("No", "Yes"), _label(r, _BINARY, w))


def _copa(r, w):
    premise, question = _field(r, "premise", w), _field(r, "question", w)
    if question not in ("cause", "effect"):
        raise DataFormatError(*w, f"field 'question' must be 'cause' or 'effect', got {question!r}")
    choices = [_field(r, "choice1", w), _field(r, "choice2", w)]
    conjunction = " because " if question == "cause" else " so "
    premise = premise.rstrip()
    premise = premise[:-1] if premise.endswith(".") else premise
    return Rendered(premise + conjunction, tuple(_lower_first_word(c) for c in choices),
                    _label(r, {0: 0, 1: 1}, w))


def _lower_first_word(text: str) -> str:
    """MeZO's COPA capitalization: the choice continues the sentence, so its first word is lowercased ("I" kept)."""
    first, *rest = text.split(" ")
    return " ".join([first if first == "I" else first.lower(), *rest])


TEMPLATES = {"rte": _rte, "cb": _cb, "boolq": _boolq, "wsc": _wsc, "wic": _wic, "multirc": _multirc, "copa": _copa}
"""MeZO's templates and verbalizers, by task kind (SST-2's is `task.template`/`task.verbalizer`)."""


def squad_prompt(record: dict, where: tuple[str, int]) -> tuple[str, list[str]]:
    """MeZO's SQuAD prompt and the row's gold answers (the first one is trained on)."""
    context, question = _field(record, "context", where), _field(record, "question", where).strip()
    title = record.get("title") or ""
    answers = record.get("answers")
    texts = answers.get("text") if isinstance(answers, dict) else answers
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t.strip() for t in texts):
        raise DataFormatError(*where, f"field 'answers' must hold a non-empty list of answer texts "
                                      f"({{'text': [...]}} as SQuAD has it), got {answers!r}")
    return f"Title: {title}\nContext: {context}\nQuestion: {question}\nAnswer:", texts


# ---------------------------------------------------------------- reading and sampling


def read_splits(config: TaskConfig) -> tuple[list, list, str]:
    """(train rows, held-out rows, the held-out rows' source) as (line, record) pairs, before sampling: held-out
    rows from `eval_path`, else the folder's `eval_split`, else held out of the data by SHA-256."""
    path = Path(config.data_path)
    kind = data_format(path, config.data_format)
    train = read_records(path, kind, config.split)
    if config.eval_path is not None:
        return train, read_records(config.eval_path, config.data_format, config.eval_split), config.eval_path
    if has_split(path, config.eval_split, kind):
        return train, read_records(path, kind, config.eval_split), f"{path} ({config.eval_split})"
    if config.eval_size >= len(train):
        raise WorkloadError(f"task.eval_size={config.eval_size} holds out every row of {path} ({len(train)} rows); "
                            "lower eval_size or give held-out rows in task.eval_path")
    ranked = sorted(range(len(train)), key=lambda i: (row_rank(config.data_seed, train[i][1]), i))
    held = set(ranked[:config.eval_size])
    return ([r for i, r in enumerate(train) if i not in held], [r for i, r in enumerate(train) if i in held],
            f"{path} (held out)")


def build_mezo_task(config: TaskConfig, tokenizer: TextTokenizer):
    """The task of MeZO kind `config.kind` (see the module docstring)."""
    train, held, source = read_splits(config)
    if config.num_train is not None and source.endswith("(held out)"):
        raise WorkloadError("MeZO's sampler (task.num_train) draws held-out rows from a validation split: give "
                            "task.eval_path, or a save_to_disk folder with task.eval_split")
    path = str(config.data_path)
    eval_path = str(config.eval_path or config.data_path)
    if config.kind == "squad":
        train, dev, held = sample_rows(config, train, held, lambda row: None, lambda row: row[1])
        return SquadTask(config, tokenizer, _squad_examples(config, tokenizer, train, path),
                         _squad_examples(config, tokenizer, held, eval_path),
                         _squad_examples(config, tokenizer, dev, path))
    render = TEMPLATES[config.kind]
    rendered_train = [(record, render(record, (path, line))) for line, record in train]
    rendered_train, rendered_dev, held = sample_rows(config, rendered_train, held, lambda row: row[1].label,
                                                     lambda row: row[0])
    rendered_held = [render(record, (eval_path, line)) for line, record in held]

    def examples(rendered):
        return candidate_examples(config, tokenizer, [r.prompt for r in rendered], [r.options for r in rendered],
                                  [r.label for r in rendered])

    cls = PromptLanguageModelTask if config.kind == "copa" else PromptClassificationTask
    return cls(config, tokenizer, examples([r for _, r in rendered_train]), examples(rendered_held),
               examples([r for _, r in rendered_dev]))


# ---------------------------------------------------------------- SQuAD


MAX_NEW_TOKENS = 50
"""MeZO's `max_new_tokens`; SQuAD's sequences leave room for them, in training too."""


@dataclass(frozen=True)
class AnswerExample:
    prompt: list[int]
    """The prompt's ids, untruncated."""
    sequence: list[int]
    """The prompt and " <first answer>\n" (trained on), untruncated."""
    answer_len: int
    """The answer's tokens at `sequence`'s end."""
    answers: tuple[str, ...]
    """Every gold answer (F1 and exact match take the best)."""


def _squad_examples(config: TaskConfig, tokenizer: TextTokenizer, rows: list, path: str) -> list[AnswerExample]:
    room = config.max_length - MAX_NEW_TOKENS
    if room < 2:
        raise WorkloadError(f"task.max_length={config.max_length} leaves no room for a SQuAD prompt beside MeZO's "
                            f"{MAX_NEW_TOKENS} new tokens; raise task.max_length above {MAX_NEW_TOKENS + 1}")
    if not rows:
        return []
    rendered = [(line, *squad_prompt(record, (path, line))) for line, record in rows]
    prompts = [prompt for _, prompt, _ in rendered]
    prompt_ids = tokenizer.encode([p.strip(" ") for p in prompts])
    encoded = mezo_encode(tokenizer, prompts, [f"{prompt} {answers[0]}\n" for _, prompt, answers in rendered])
    out = []
    for (line, _, answers), ids, (sequence, n) in zip(rendered, prompt_ids, encoded):
        if n < 1 or n >= room:
            raise DataFormatError(path, line, f"the answer takes {n} tokens, which leaves no room for the prompt "
                                              f"within task.max_length={config.max_length} less MeZO's "
                                              f"{MAX_NEW_TOKENS} new tokens")
        out.append(AnswerExample(ids, sequence, n, tuple(answers)))
    return out


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
    """`squad`: the loss is the answer tokens' mean cross-entropy after the prompt; evaluation decodes greedily
    and scores F1 and exact match."""

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
        """MeZO's greedy answer: up to `max_answer_tokens` within `max_length`, stopping at the id of "\n" or EOS."""
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


__all__ = ["TEMPLATES", "SquadTask", "build_mezo_task", "f1_score", "normalize_answer", "squad_prompt"]
