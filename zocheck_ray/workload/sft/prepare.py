"""Kind sft's examples: `SFTRow`s tokenized as TRL 1.16's `SFTTrainer` prepares them with its defaults.

    splits = encode_sft(config, tokenizer, splits)       # the examples stage of build_task, for kind sft

Per row, as `SFTTrainer._prepare_dataset`: EOS appended to a text or completion that lacks it; the tokenizer
on text or its `apply_chat_template` on messages; the completion starts where the prompt's ids and the whole's
diverge; labels are the ids where every mask in force is 1; then ids and labels are cut to `max_length`, and a
row left with no label is dropped.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Sequence

from zocheck_ray.workload.datafiles import Splits
from zocheck_ray.workload.errors import WorkloadError
from zocheck_ray.workload.sft.rows import CONVERSATIONAL, PROMPT_COMPLETION, SFTRow
from zocheck_ray.workload.task_config import TaskConfig
from zocheck_ray.workload.tokenization import HFTokenizer, TextTokenizer, hf_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTExample:
    """A row as TRL prepares it, and the prompt a held-out row generates from."""

    input_ids: list[int]
    loss_mask: list[int]
    """1 where TRL's label is the token (a target), 0 where it is -100; position t predicts token t + 1."""
    prompt_ids: list[int] | None = None
    """Held-out rows: the prompt's ids (a conversation's turns before its last assistant turn, with the template's
    generation prompt); None: nothing to generate from (language-modelling text)."""
    prompt_text: str | None = None


@dataclass(frozen=True)
class SFTSettings:
    """TRL's settings resolved for the rows at hand."""

    completion_only_loss: bool
    assistant_only_loss: bool
    chat_template: str | None
    """TRL's training template swapped in for `assistant_only_loss` (None: the tokenizer's own)."""


def has_generation_markers(chat_template: str | dict) -> bool:
    """TRL's test: the template holds `{% generation %}` (trim variants too; a dict's `default` variant)."""
    if isinstance(chat_template, dict):
        chat_template = chat_template["default"]
    return re.search(r"\{%-?\s*generation\s*-?%\}", chat_template) is not None


def resolve_settings(config: TaskConfig, tokenizer: HFTokenizer, first: SFTRow) -> SFTSettings:
    """TRL's settings for rows in `first`'s format, refused (one line naming the setting and the row) where TRL
    refuses them or they cannot be honoured."""
    tok, fmt, where = tokenizer.tokenizer, first.format, first.where
    kind = fmt.replace("_", " ")
    if config.assistant_only_loss and fmt not in CONVERSATIONAL:
        raise WorkloadError(f"task.assistant_only_loss needs conversational rows (messages), but the rows are {kind} "
                            f"({where}); TRL refuses it too: unset it, or use completion_only_loss on "
                            "prompt-completion rows")
    if config.completion_only_loss and fmt not in PROMPT_COMPLETION:
        raise WorkloadError(f"task.completion_only_loss=True needs prompt-completion rows, but the rows are {kind} "
                            f"({where}), which have no completion (TRL ignores the setting there); unset it")
    if fmt in CONVERSATIONAL and not tok.chat_template:
        raise WorkloadError(f"the rows are conversational ({where}) but the tokenizer ({tokenizer.describe()}) has no "
                            "chat template to render them; use a model whose tokenizer has one (tiny-chat), or set "
                            "tokenizer.chat_template and save it with the model")
    if fmt not in CONVERSATIONAL and tok.eos_token is None:
        raise WorkloadError(f"the tokenizer ({tokenizer.describe()}) has no eos_token, which TRL appends to every text "
                            f"and completion ({where}); use a tokenizer with one")
    chat_template = None
    if config.assistant_only_loss and not has_generation_markers(tok.chat_template):
        chat_template = training_chat_template(tokenizer)
    if config.assistant_only_loss and not stop_token_trained(tok, chat_template):
        logger.warning("the chat template leaves the assistant's end-of-turn token out of the loss mask, so the model "
                       "may not learn to stop (TRL warns too); put it inside {% generation %}...{% endgeneration %}")
    completion_only = fmt in PROMPT_COMPLETION if config.completion_only_loss is None else config.completion_only_loss
    return SFTSettings(completion_only, config.assistant_only_loss, chat_template)


def training_chat_template(tokenizer: HFTokenizer) -> str:
    """TRL's training template for a known chat template without generation markers (as `SFTTrainer` swaps it in
    for `assistant_only_loss`); refused where TRL has none or is not installed."""
    fix = ("add {% generation %}...{% endgeneration %} around the assistant's content and end-of-turn token in "
           "tokenizer.chat_template, or unset task.assistant_only_loss")
    try:
        from trl.chat_template_utils import get_training_chat_template
    except ImportError:
        raise WorkloadError(f"task.assistant_only_loss: the chat template of {tokenizer.describe()} has no "
                            "{% generation %} markers, so its assistant tokens cannot be marked; TRL swaps in a "
                            f"training template for the models it knows (pip install trl), or {fix}") from None
    try:
        template = get_training_chat_template(tokenizer.tokenizer)
    except ValueError:
        raise WorkloadError(f"task.assistant_only_loss: the chat template of {tokenizer.describe()} has no "
                            "{% generation %} markers, so its assistant tokens cannot be marked, and TRL has no "
                            f"training template for it; {fix}") from None
    return template if template is not None else tokenizer.tokenizer.chat_template


def stop_token_trained(tok, chat_template: str | None) -> bool:
    """TRL's `is_chat_template_stop_token_trained`: the last masked token of an assistant turn followed by a user
    turn is an added token (the end of the turn), not content."""
    messages = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"},
                {"role": "user", "content": "dummy"}]
    try:
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                      chat_template=chat_template)
    except Exception:  # a template that cannot render the probe: TRL answers False (a warning)
        return False
    added = set(tok.get_added_vocab().values())
    for token, masked in reversed(list(zip(out["input_ids"], out["assistant_masks"]))):
        if masked and tok.decode([token]).strip():
            return token in added
    return False


def common_prefix_length(ids: Sequence[int], other: Sequence[int]) -> int:
    """TRL's `common_prefix_length`: where two id lists first differ."""
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return n


def _template_kwargs(row: SFTRow, chat_template: str | None) -> dict:
    return {"chat_template": chat_template, "tools": row.record.get("tools"),
            **row.record.get("chat_template_kwargs", {})}


class _Warnings:
    """TRL's once-per-dataset warning that a prompt's ids are not a prefix of the whole's."""

    def __init__(self):
        self.prefix_warned = False

    def prefix(self, tok, prompt_ids: list[int], prompt_len: int) -> None:
        if not self.prefix_warned:
            self.prefix_warned = True
            logger.warning("the tokenized prompt is not a prefix of the tokenized prompt+completion (as TRL warns): "
                           "the completion starts where they diverge, and %r is left out of the training sequence",
                           tok.decode(prompt_ids[prompt_len:]))


def tokenize_row(tok, row: SFTRow, settings: SFTSettings, warnings: _Warnings | None = None) -> tuple[list, list]:
    """(input ids, loss mask) of one row before truncation, as TRL's `add_eos`, `tokenize_fn` and `build_labels`."""
    record, fmt = row.record, row.format
    masks: list[list[int]] = []
    if fmt in PROMPT_COMPLETION:
        if fmt == "conversational_prompt_completion":
            kwargs = _template_kwargs(row, settings.chat_template)
            prompt_ids = tok.apply_chat_template(record["prompt"], tokenize=True, return_dict=True,
                                                 add_generation_prompt=True, **kwargs)["input_ids"]
            whole = tok.apply_chat_template(record["prompt"] + record["completion"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=settings.assistant_only_loss, **kwargs)
            ids = list(whole["input_ids"])
            if "assistant_masks" in whole:
                masks.append(list(whole["assistant_masks"]))
        else:
            completion = record["completion"]
            if not completion.endswith(tok.eos_token):
                completion += tok.eos_token
            prompt_ids = tok(text=record["prompt"])["input_ids"]
            ids = list(tok(text=record["prompt"] + completion)["input_ids"])
        prompt_len = common_prefix_length(prompt_ids, ids)
        if prompt_len < len(prompt_ids) and warnings is not None:
            warnings.prefix(tok, list(prompt_ids), prompt_len)
        if settings.completion_only_loss:
            masks.insert(0, [0] * prompt_len + [1] * (len(ids) - prompt_len))
    elif fmt == "conversational_language_modeling":
        out = tok.apply_chat_template(record["messages"], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=settings.assistant_only_loss,
                                      **_template_kwargs(row, settings.chat_template))
        ids = list(out["input_ids"])
        if "assistant_masks" in out:
            masks.append(list(out["assistant_masks"]))
    else:
        text = record["text"]
        if not text.endswith(tok.eos_token):
            text += tok.eos_token
        ids = list(tok(text=text)["input_ids"])
    if settings.assistant_only_loss and masks and 1 not in masks[-1]:
        raise row.where.error("task.assistant_only_loss: the chat template marks none of this row's tokens as the "
                              "assistant's (TRL raises here too); check the template's {% generation %} span")
    # TRL's build_labels: a label where every mask in force is 1 (each mask is as long as the ids)
    return ids, [int(all(bits)) for _, *bits in zip(ids, *masks)]


def truncate(ids: list[int], mask: list[int], max_length: int, mode: str) -> tuple[list[int], list[int]]:
    """TRL's truncation: the first `max_length` (`keep_start`) or the last (`keep_end`)."""
    cut = slice(None, max_length) if mode == "keep_start" else slice(-max_length, None)
    return ids[cut], mask[cut]


def generation_prompt(tok, row: SFTRow) -> tuple[list[int], str] | None:
    """(ids, text) a held-out row generates from, with the tokenizer's own template; None for plain text."""
    record = row.record
    if row.format == "prompt_completion":
        return list(tok(text=record["prompt"])["input_ids"]), record["prompt"]
    if row.format == "language_modeling":
        return None
    if row.format == "conversational_prompt_completion":
        messages = record["prompt"]
    else:
        last = max(i for i, m in enumerate(record["messages"]) if m["role"] == "assistant")
        messages = record["messages"][:last]
        if not messages:
            return None
    kwargs = _template_kwargs(row, None)
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True,
                                  **kwargs)["input_ids"]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return list(ids), text


def encode_rows(config: TaskConfig, tokenizer: HFTokenizer, rows: list[SFTRow], settings: SFTSettings,
                prompts: bool = False) -> tuple[list[SFTExample], list[SFTRow]]:
    """(examples, rows dropped with no label left after truncation), in order; `prompts`: with generation prompts."""
    tok, warnings = tokenizer.tokenizer, _Warnings()
    examples, dropped = [], []
    for row in rows:
        ids, mask = truncate(*tokenize_row(tok, row, settings, warnings), config.max_length, config.truncation_mode)
        if 1 not in mask:
            dropped.append(row)
            continue
        prompt = generation_prompt(tok, row) if prompts else None
        examples.append(SFTExample(ids, mask, *(prompt or (None, None))))
    return examples, dropped


def encode_sft(config: TaskConfig, tokenizer: TextTokenizer, splits: Splits) -> Splits:
    """`SFTRow`s as `SFTExample`s, TRL's settings resolved for their format; held-out rows with their prompts."""
    tokenizer = hf_tokenizer(tokenizer)
    settings = resolve_settings(config, tokenizer, splits.train[0])
    train, lost = encode_rows(config, tokenizer, splits.train, settings)
    held, lost_held = encode_rows(config, tokenizer, splits.held, settings, prompts=True)
    dev, lost_dev = encode_rows(config, tokenizer, splits.dev, settings)
    dropped = [*lost, *lost_held, *lost_dev]
    if dropped:
        logger.warning("%d SFT row(s) have no trained token left within task.max_length=%d (%s) and are dropped, as "
                       "TRL drops them: %s%s", len(dropped), config.max_length, config.truncation_mode,
                       ", ".join(str(r.where) for r in dropped[:5]), " ..." if len(dropped) > 5 else "")
    for name, kept, rows in (("training", train, splits.train), ("held-out", held, splits.held)):
        if not kept:
            raise WorkloadError(f"every {name} row ({len(rows)}, from {rows[0].where}) loses its trained tokens to "
                                f"truncation at task.max_length={config.max_length} ({config.truncation_mode}); "
                                "raise max_length or set task.truncation_mode")
    return Splits(train, held, dev)


__all__ = ["SFTExample", "SFTSettings", "common_prefix_length", "encode_rows", "encode_sft", "generation_prompt",
           "has_generation_markers", "hf_tokenizer", "resolve_settings", "stop_token_trained", "tokenize_row",
           "training_chat_template", "truncate"]
