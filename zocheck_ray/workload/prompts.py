"""Each sampled row's prompt and candidates, as MeZO's templates.py writes them.

    TEMPLATES["rte"](READERS["rte"](record, where)[0])   # (prompt, candidates)
"""

from __future__ import annotations

from dataclasses import dataclass

from zocheck_ray.workload.datafiles import Splits
from zocheck_ray.workload.rows import TaskRow
from zocheck_ray.workload.task_config import TaskConfig

YES_NO = ("Yes", "No")


@dataclass(frozen=True)
class Rendered:
    """A row as MeZO prompts it."""

    prompt: str
    options: tuple[str, ...]
    """Candidates in class order; SQuAD: the gold answers."""
    label: int
    path: str
    line: int


def _boolq(f):
    # MeZO's default BoolQ template (its version 2)
    question = f["question"] if f["question"].endswith("?") else f["question"] + "?"
    return f"{f['passage']} {question[0].upper() + question[1:]}\n", YES_NO


def _copa(f):
    premise = f["premise"].rstrip()
    premise = premise[:-1] if premise.endswith(".") else premise
    conjunction = " because " if f["question"] == "cause" else " so "
    return premise + conjunction, (_lower_first_word(f["choice1"]), _lower_first_word(f["choice2"]))


def _lower_first_word(text: str) -> str:
    """MeZO's COPA capitalization: the choice continues the sentence, so its first word is lowercased ("I" kept)."""
    first, *rest = text.split(" ")
    return " ".join([first if first == "I" else first.lower(), *rest])


def squad_prompt(f: dict) -> tuple[str, tuple[str, ...]]:
    """MeZO's SQuAD prompt and the row's gold answers."""
    prompt = f"Title: {f['title']}\nContext: {f['context']}\nQuestion: {f['question'].strip()}\nAnswer:"
    return prompt, tuple(f["answers"])


TEMPLATES = {
    "rte": lambda f: (f"{f['premise']}\nDoes this mean that \"{f['hypothesis']}\" is true? Yes or No?\n", YES_NO),
    "cb": lambda f: (f"Suppose {f['premise']} Can we infer that \"{f['hypothesis']}\"? Yes, No, or Maybe?\n",
                     (*YES_NO, "Maybe")),
    "boolq": _boolq,
    "wsc": lambda f: (f"{f['text']}\nIn the previous sentence, does the pronoun \"{f['span2_text'].lower()}\" refer "
                      f"to {f['span1_text']}? Yes or No?\n", ("No", "Yes")),
    "wic": lambda f: (f"Does the word \"{f['word']}\" have the same meaning in these two sentences? Yes, No?\n"
                      f"{f['sentence1']}\n{f['sentence2']}\n", ("No", "Yes")),
    "multirc": lambda f: (f"{f['paragraph']}\nQuestion: {f['question']}\nI found this answer \"{f['answer']}\". Is "
                          "that correct? Yes or No?\n", ("No", "Yes")),
    "copa": _copa,
    "squad": squad_prompt,
}
"""MeZO's templates and verbalizers: fields -> (prompt, candidates)."""


def _template(config: TaskConfig):
    if config.kind in TEMPLATES:
        return TEMPLATES[config.kind]
    if config.kind == "sst2":
        words = tuple(" " + word for word in config.verbalizer.values())
        return lambda f: (config.template.format(text=f["text"].strip()), words)
    return lambda f: (f["text"], ())


def render(config: TaskConfig, splits: Splits) -> Splits:
    """`TaskRow`s as `Rendered`; `sst2` formats `task.template` with the stripped text, as MeZO's SST2Template;
    kind sft's rows pass as they are."""
    if config.kind == "sft":
        return splits
    template = _template(config)

    def rendered(rows: list[TaskRow]) -> list[Rendered]:
        return [Rendered(*template(row.fields), row.label, row.path, row.line) for row in rows]
    return Splits(rendered(splits.train), rendered(splits.held), rendered(splits.dev))


__all__ = ["Rendered", "TEMPLATES", "render", "squad_prompt"]
