"""Kind sft's rows in TRL's four dataset formats, told from the first row's columns, every row checked.

    splits = check_sft_rows(config, read_splits(config, rows=dataset))   # (Where, record) pairs -> SFTRows

| format | columns |
| --- | --- |
| `language_modeling` | `text` (`task.text_field`): a string |
| `conversational_language_modeling` | `messages`: a list of `{"role", "content"}` |
| `prompt_completion` | `prompt` and `completion`: strings |
| `conversational_prompt_completion` | `prompt` and `completion`: lists of messages |

Other columns are ignored, as by TRL, except `tools` and `chat_template_kwargs`, which go to the chat template.
A null column or message key counts as absent, since `datasets` fills what some rows lack with nulls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Literal

from zocheck_ray.workload.datafiles import Splits, Where
from zocheck_ray.workload.task_config import TaskConfig

SFTFormat = Literal["language_modeling", "conversational_language_modeling", "prompt_completion",
                    "conversational_prompt_completion"]
CONVERSATIONAL = ("conversational_language_modeling", "conversational_prompt_completion")
PROMPT_COMPLETION = ("prompt_completion", "conversational_prompt_completion")
ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have."""


@dataclass(frozen=True)
class SFTRow:
    """A checked row: its format and its canonical record (the format's columns under TRL's names, `text` for the
    text, nulls dropped), which the fingerprint and the tokenizer read."""

    format: SFTFormat
    record: dict
    where: Where

    label = -1
    """No class: the samplers treat every row alike."""

    @property
    def content(self) -> dict:
        """What the samplers rank."""
        return self.record

    @property
    def path(self) -> str:
        return self.where.source

    @property
    def line(self) -> int:
        return self.where.index


def _present(record: dict, column: str) -> bool:
    return record.get(column) is not None


def row_format(record: dict, text_field: str, where: Where) -> SFTFormat:
    """The TRL format of one row, from the columns it has (not null)."""
    found = []
    if _present(record, text_field):
        found.append("language_modeling")
    if _present(record, "messages"):
        found.append("conversational_language_modeling")
    if _present(record, "prompt") and _present(record, "completion"):
        lists = [isinstance(record[c], list) for c in ("prompt", "completion")]
        if lists[0] != lists[1]:
            raise where.error("'prompt' and 'completion' must both be strings (prompt-completion) or both lists of "
                              f"messages (conversational prompt-completion), got {type(record['prompt']).__name__} "
                              f"and {type(record['completion']).__name__}")
        found.append("conversational_prompt_completion" if lists[0] else "prompt_completion")
    if not found:
        raise where.error(
            f"no SFT format's columns (the row has {sorted(k for k in record if _present(record, k))}); TRL's formats "
            f"need {text_field!r} (language modelling; the column is task.text_field), 'messages' (conversational), or "
            "'prompt' and 'completion' (prompt-completion)")
    if len(found) > 1:
        raise where.error(f"the row has the columns of several formats ({', '.join(found)}); TRL would read one "
                          "of them: keep one format's columns")
    return found[0]


def _text(value: object, column: str, where: Where) -> str:
    if not isinstance(value, str):
        raise where.error(f"field {column!r} must be a string, got {type(value).__name__} {value!r}")
    return value


def _messages(value: object, column: str, where: Where) -> list[dict]:
    """The column's messages, each with a role from `ROLES` and a string content; null keys dropped."""
    if not isinstance(value, list) or not value:
        raise where.error(f"field {column!r} must be a non-empty list of messages ({{'role': ..., 'content': ...}}), "
                          f"got {value!r}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise where.error(f"{column}[{i}] must be a message {{'role': ..., 'content': ...}}, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        missing = [k for k in ("role", "content") if k not in message]
        if missing:
            raise where.error(f"{column}[{i}] has no {' and no '.join(repr(k) for k in missing)} (it has "
                              f"{sorted(message)}); a message needs 'role' and 'content'")
        if message["role"] not in ROLES:
            raise where.error(f"{column}[{i}] has role {message['role']!r}; a role is one of {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise where.error(f"{column}[{i}]'s content must be a string, got {type(message['content']).__name__} "
                              f"{message['content']!r} (text only)")
        out.append(message)
    return out


def _has_assistant(messages: list[dict]) -> bool:
    return any(m["role"] == "assistant" for m in messages)


def _template_columns(record: dict, where: Where) -> dict:
    out = {}
    if _present(record, "tools"):
        tools = record["tools"]
        if isinstance(tools, str):  # as TRL: a JSON string, which keeps a tool's schema out of datasets' typing
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as exc:
                raise where.error(f"field 'tools' is a string but not JSON ({exc.msg})") from None
        if not isinstance(tools, list):
            raise where.error(f"field 'tools' must be a list of tool schemas (or its JSON), got {tools!r}")
        out["tools"] = tools
    if _present(record, "chat_template_kwargs"):
        if not isinstance(record["chat_template_kwargs"], dict):
            raise where.error(f"field 'chat_template_kwargs' must be a mapping, got {record['chat_template_kwargs']!r}")
        out["chat_template_kwargs"] = record["chat_template_kwargs"]
    return out


def check_row(record: object, text_field: str, where: Where, expected: SFTFormat | None = None,
              first: Where | None = None) -> SFTRow:
    """One row checked: a dict in `expected` format (the first row's, at `first`)."""
    if not isinstance(record, dict):
        raise where.error(f"expected a row of named columns (a JSON object), got {type(record).__name__}")
    fmt = row_format(record, text_field, where)
    if expected is not None and fmt != expected:
        raise where.error(f"the row is {fmt.replace('_', ' ')} but the first row ({first}) is "
                          f"{expected.replace('_', ' ')}; a dataset holds one format (as TRL reads it)")
    if fmt == "language_modeling":
        canonical = {"text": _text(record[text_field], text_field, where)}
    elif fmt == "prompt_completion":
        canonical = {c: _text(record[c], c, where) for c in ("prompt", "completion")}
    elif fmt == "conversational_language_modeling":
        canonical = {"messages": _messages(record["messages"], "messages", where)}
        if not _has_assistant(canonical["messages"]):
            raise where.error("the conversation has no assistant turn, so nothing in it is the model's to learn; add "
                              "the assistant's reply (role 'assistant')")
        canonical.update(_template_columns(record, where))
    else:
        canonical = {c: _messages(record[c], c, where) for c in ("prompt", "completion")}
        if not _has_assistant(canonical["completion"]):
            raise where.error("the completion has no assistant turn; a conversational completion is the assistant's "
                              "reply (role 'assistant')")
        canonical.update(_template_columns(record, where))
    return SFTRow(fmt, canonical, where)


def check_rows(records: Iterable[tuple[Where, object]], text_field: str = "text") -> list[SFTRow]:
    """Every record checked, all in the first one's format."""
    rows: list[SFTRow] = []
    for where, record in records:
        rows.append(check_row(record, text_field, where, rows[0].format if rows else None,
                              rows[0].where if rows else None))
    return rows


def sft_rows(rows, text_field: str = "text", source: str = "dataset") -> list[SFTRow]:
    """The checked rows of a `datasets.Dataset` or a list of dicts; errors name `<source> row <index>`."""
    return check_rows(((Where(source, i, False), record) for i, record in enumerate(rows)), text_field)


def check_sft_rows(config: TaskConfig, splits: Splits) -> Splits:
    """`read_splits`' (where, record) pairs as `SFTRow`s: every row in the first training row's format."""
    train = check_rows(splits.train, config.text_field)
    held = None if splits.held is None else check_rows(splits.held, config.text_field)
    if held is not None and held[0].format != train[0].format:
        raise held[0].where.error(f"the held-out rows are {held[0].format.replace('_', ' ')} but the training rows "
                                  f"({train[0].where}) are {train[0].format.replace('_', ' ')}; use one format")
    return Splits(train, held, [])


__all__ = ["CONVERSATIONAL", "PROMPT_COMPLETION", "ROLES", "SFTFormat", "SFTRow", "check_row", "check_rows",
           "check_sft_rows", "row_format", "sft_rows"]
