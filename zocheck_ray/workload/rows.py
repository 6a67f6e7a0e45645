"""Every record read, checked and labelled before sampling: a bad row is refused, drawn or not.

    splits = check_rows(config, read_splits(config))
"""

from __future__ import annotations

from dataclasses import dataclass

from zocheck_ray.workload.datafiles import Row, Splits
from zocheck_ray.workload.errors import DataFormatError, LabelError
from zocheck_ray.workload.sft.rows import check_sft_rows
from zocheck_ray.workload.task_config import MEZO_KINDS, TaskConfig


@dataclass(frozen=True)
class TaskRow:
    """The fields a template reads, the class (-1: none), where it came from."""

    fields: dict
    label: int
    path: str
    line: int
    content: object
    """What the samplers rank."""


def _field(record: dict, name: str, where: tuple[str, int]) -> str:
    if name not in record:
        raise DataFormatError(*where, f"missing field {name!r} (the row has {sorted(record)}); MeZO's task reads "
                                      "the SuperGLUE/SQuAD field names")
    value = record[name]
    if not isinstance(value, str) or not value.strip():
        raise DataFormatError(*where, f"field {name!r} must be a non-empty string, got {value!r}")
    return value


def _fields(record: dict, where: tuple[str, int], *names: str) -> dict:
    return {name: _field(record, name, where) for name in names}


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


def _boolq(r, w):
    # SuperGLUE's BoolQ has `label`, the `boolq` dataset `answer`; MeZO's verbalizer puts "Yes" first.
    fields = _fields(r, w, "passage", "question")
    return fields, 1 - _label(r, _BINARY, w, "label" if "label" in r or "answer" not in r else "answer")


def _copa(r, w):
    fields = _fields(r, w, "premise", "question")
    if fields["question"] not in ("cause", "effect"):
        raise DataFormatError(*w, f"field 'question' must be 'cause' or 'effect', got {fields['question']!r}")
    return fields | _fields(r, w, "choice1", "choice2"), _label(r, {0: 0, 1: 1}, w)


def _squad(r, w):
    fields = _fields(r, w, "context", "question")
    answers = r.get("answers")
    texts = answers.get("text") if isinstance(answers, dict) else answers
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t.strip() for t in texts):
        raise DataFormatError(*w, f"field 'answers' must hold a non-empty list of answer texts "
                                  f"({{'text': [...]}} as SQuAD has it), got {answers!r}")
    return fields | {"title": r.get("title") or "", "answers": texts}, -1


READERS = {
    "rte": lambda r, w: (_fields(r, w, "premise", "hypothesis"), _label(r, _ENTAILMENT, w)),
    "cb": lambda r, w: (_fields(r, w, "premise", "hypothesis"), _label(r, _CB, w)),
    "boolq": _boolq,
    "wsc": lambda r, w: (_fields(r, w, "text", "span1_text", "span2_text"), _label(r, _BINARY, w)),
    "wic": lambda r, w: (_fields(r, w, "word", "sentence1", "sentence2"), _label(r, _BINARY, w)),
    "multirc": lambda r, w: (_fields(r, w, "paragraph", "question", "answer"), _label(r, _BINARY, w)),
    "copa": _copa,
    "squad": _squad,
}
"""(record, (path, line)) -> (fields, class), with the SuperGLUE and SQuAD names `datasets` gives."""


def _class_index(config: TaskConfig, row: Row) -> int:
    try:
        return config.labels.index(str(row.label))
    except ValueError:
        raise LabelError(row.path, row.line, row.label, config.labels) from None


def check_rows(config: TaskConfig, splits: Splits) -> Splits:
    """`read_splits`' records as `TaskRow`s (kind sft: `SFTRow`s), training rows first."""
    if config.kind == "sft":
        return check_sft_rows(config, splits)
    if config.kind in MEZO_KINDS:
        read = READERS[config.kind]

        def rows(records: list, path: str) -> list[TaskRow]:
            return [TaskRow(*read(record, (path, line)), path, line, record) for line, record in records]
        train = rows(splits.train, str(config.data_path))
        held = None if splits.held is None else rows(splits.held, str(config.eval_path or config.data_path))
        return Splits(train, held, [])

    def text_rows(rows: list[Row]) -> list[TaskRow]:
        return [TaskRow({"text": r.text}, -1 if config.kind == "lm" else _class_index(config, r), r.path, r.line,
                        {"text": r.text, "label": r.label}) for r in rows]
    return Splits(text_rows(splits.train), None if splits.held is None else text_rows(splits.held), [])


__all__ = ["READERS", "TaskRow", "check_rows"]
