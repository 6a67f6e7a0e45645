"""Rendered rows as token ids, counted as MeZO's `encode_prompt`; a task truncates them as it collates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from zocheck_ray.workload.datafiles import Splits
from zocheck_ray.workload.errors import DataFormatError, TaskModelMismatchError, WorkloadError
from zocheck_ray.workload.prompts import Rendered
from zocheck_ray.workload.sft.prepare import encode_sft
from zocheck_ray.workload.task_config import MEZO_KINDS, TaskConfig
from zocheck_ray.workload.tokenization import TextTokenizer

MAX_NEW_TOKENS = 50
"""MeZO's `max_new_tokens`; SQuAD's sequences leave room for them, in training too."""


@dataclass(frozen=True)
class PromptExample:
    sequences: list[list[int]]
    """Each candidate's ids after the prompt's, untruncated, in class order."""
    option_lens: list[int]
    """MeZO's `option_len`: how many last tokens are the candidate's."""
    label: int


@dataclass(frozen=True)
class TextExample:
    ids: list[int]
    label: int


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


def mezo_encode(tokenizer: TextTokenizer, prompts: list[str], wholes: list[str]) -> list[tuple[list[int], int]]:
    """(ids of each whole text, its token count less the prompt's), as MeZO's `encode_prompt`."""
    prompt_ids = tokenizer.encode([p.strip(" ") for p in prompts])
    whole_ids = tokenizer.encode([w.strip(" ") for w in wholes])
    return [(ids, len(ids) - len(p)) for p, ids in zip(prompt_ids, whole_ids)]


def candidate_examples(config: TaskConfig, tokenizer: TextTokenizer, prompts: list[str],
                       options: list[Sequence[str]], labels: list[int], what: str = "candidate") -> list[PromptExample]:
    """Prompt-classification examples: each prompt followed by each candidate's text (`mezo_encode`)."""
    if not prompts:
        return []
    width = max(len(o) for o in options)
    per_option = [mezo_encode(tokenizer, prompts, [p + (o[k] if k < len(o) else "") for p, o in zip(prompts, options)])
                  for k in range(width)]
    examples = []
    for i, label in enumerate(labels):
        encoded = [per_option[k][i] for k in range(len(options[i]))]
        for text, (_, n) in zip(options[i], encoded):
            if n < 1 or n >= config.max_length:
                raise TaskModelMismatchError(
                    f"{what} {text.strip()!r} takes {n} tokens with {tokenizer.describe()}, which leaves "
                    f"no room for the prompt within task.max_length={config.max_length}; raise max_length or "
                    "choose shorter words")
        examples.append(PromptExample([ids for ids, _ in encoded], [n for _, n in encoded], label))
    return examples


def _answer_examples(config: TaskConfig, tokenizer: TextTokenizer, rows: list[Rendered]) -> list[AnswerExample]:
    room = config.max_length - MAX_NEW_TOKENS
    if room < 2:
        raise WorkloadError(f"task.max_length={config.max_length} leaves no room for a SQuAD prompt beside MeZO's "
                            f"{MAX_NEW_TOKENS} new tokens; raise task.max_length above {MAX_NEW_TOKENS + 1}")
    if not rows:
        return []
    prompt_ids = tokenizer.encode([r.prompt.strip(" ") for r in rows])
    encoded = mezo_encode(tokenizer, [r.prompt for r in rows], [f"{r.prompt} {r.options[0]}\n" for r in rows])
    out = []
    for row, ids, (sequence, n) in zip(rows, prompt_ids, encoded):
        if n < 1 or n >= room:
            raise DataFormatError(row.path, row.line, f"the answer takes {n} tokens, which leaves no room for the "
                                                      f"prompt within task.max_length={config.max_length} less "
                                                      f"MeZO's {MAX_NEW_TOKENS} new tokens")
        out.append(AnswerExample(ids, sequence, n, row.options))
    return out


def _text_examples(config: TaskConfig, tokenizer: TextTokenizer, rows: list[Rendered]) -> list[TextExample]:
    encoded = tokenizer.encode([r.prompt for r in rows], max_length=config.max_length)
    examples = []
    for row, ids in zip(rows, encoded):
        if config.kind == "lm" and len(ids) < 2:
            raise DataFormatError(row.path, row.line, f"the text encodes to {len(ids)} token(s) with "
                                                      f"{tokenizer.describe()}; language modelling needs at least 2")
        examples.append(TextExample(ids, row.label))
    return examples


def encode_examples(config: TaskConfig, tokenizer: TextTokenizer, splits: Splits) -> Splits:
    """`Rendered` rows as examples, training rows first (kind sft: `SFTRow`s as TRL prepares them)."""
    if config.kind == "sft":
        return encode_sft(config, tokenizer, splits)
    if config.kind == "squad":
        def encode(rows):
            return _answer_examples(config, tokenizer, rows)
    elif config.kind == "sst2" or config.kind in MEZO_KINDS:
        what = "verbalizer word" if config.kind == "sst2" else "candidate"

        def encode(rows):
            return candidate_examples(config, tokenizer, [r.prompt for r in rows], [r.options for r in rows],
                                      [r.label for r in rows], what)
    else:
        def encode(rows):
            return _text_examples(config, tokenizer, rows)
    train, held = encode(splits.train), encode(splits.held)
    return Splits(train, held, encode(splits.dev))


__all__ = ["AnswerExample", "MAX_NEW_TOKENS", "PromptExample", "TextExample", "candidate_examples",
           "encode_examples", "mezo_encode"]
