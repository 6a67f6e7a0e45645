"""The shipped sentiment dataset: what it holds, and that this generator reproduces it byte for byte.

Regenerate it (only when changing the generator on purpose):

    PYTHONPATH=. python tests/unit/test_workload_shipped_data.py
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

from zocheck_ray.workload.datafiles import SHIPPED_SST2, read_rows
from zocheck_ray.workload.sampling import split_rows
from zocheck_ray.workload.task_config import TaskConfig

SUBJECTS = [
    "the film", "this movie", "the plot", "the acting", "the ending", "the soundtrack", "the cast",
    "the script", "the story", "the dialogue", "the pacing", "the visuals", "the sequel", "the lead",
    "the humor", "the finale", "this show", "the score",
]
POSITIVE = [
    "wonderful", "delightful", "brilliant", "charming", "moving", "funny", "beautiful", "gripping",
    "superb", "fresh", "clever", "warm", "stunning", "joyful", "lovely", "excellent", "sweet", "smart",
]
NEGATIVE = [
    "dull", "boring", "awful", "clumsy", "tedious", "bland", "messy", "painful", "lifeless", "silly",
    "weak", "stale", "flat", "dreary", "sloppy", "lame", "poor", "ugly",
]
ADVERBS = ["", "truly ", "really ", "so ", "quite ", "very "]
PATTERNS = [
    "{subj} was {adv}{adj}",
    "{subj} is {adv}{adj}",
    "i found {subj} {adv}{adj}",
    "{subj} felt {adj} and {adj2}",
    "what a {adj} film",
    "a {adj} and {adj2} movie",
    "{adj} from start to finish",
    "{subj} was {adj}, and {subj2} was {adj2}",
    "simply {adj}",
    "{subj} looked {adv}{adj}",
]
ROWS_PER_LABEL = 240
MAX_TEXT_BYTES = 46  # BOS + text + " It was" + " terrible" fit the tiny models' 64 positions


def _pick(key: str, options: list[str]) -> str:
    # SHA-256 picks: the same file on every Python version (no `random` module state).
    digest = hashlib.sha256(key.encode()).digest()
    return options[int.from_bytes(digest[:8], "little") % len(options)]


def generate_sst2_small() -> list[dict]:
    """Balanced, de-duplicated sentiment rows; the labels alternate so any prefix is balanced."""
    by_label: dict[int, list[str]] = {0: [], 1: []}
    for label, words in ((1, POSITIVE), (0, NEGATIVE)):
        seen: set[str] = set()
        i = 0
        while len(by_label[label]) < ROWS_PER_LABEL:
            key = f"sst2-small:{label}:{i}"
            i += 1
            text = _pick(key + ":pattern", PATTERNS).format(
                subj=_pick(key + ":subj", SUBJECTS), subj2=_pick(key + ":subj2", SUBJECTS),
                adj=_pick(key + ":adj", words), adj2=_pick(key + ":adj2", words), adv=_pick(key + ":adv", ADVERBS))
            if text in seen or len(text.encode()) > MAX_TEXT_BYTES:
                continue
            seen.add(text)
            by_label[label].append(text)
    rows = []
    for pos, neg in zip(by_label[1], by_label[0]):
        rows.append({"sentence": pos, "label": 1})
        rows.append({"sentence": neg, "label": 0})
    return rows


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def test_shipped_dataset_is_what_the_generator_writes():
    assert SHIPPED_SST2.read_text() == render(generate_sst2_small())


def test_shipped_dataset_is_balanced_unique_and_short():
    rows = read_rows(SHIPPED_SST2, "sentence", "label")
    assert len(rows) == 2 * ROWS_PER_LABEL
    assert Counter(r.label for r in rows) == {1: ROWS_PER_LABEL, 0: ROWS_PER_LABEL}
    assert len({r.text for r in rows}) == len(rows)
    assert max(len(r.text.encode()) for r in rows) <= MAX_TEXT_BYTES


def test_default_held_out_split_is_disjoint_and_roughly_balanced():
    config = TaskConfig()
    rows = read_rows(SHIPPED_SST2, "sentence", "label")
    train, held_out = split_rows(rows, config.eval_size)
    assert len(held_out) == config.eval_size and len(train) == len(rows) - config.eval_size
    assert not {r.text for r in train} & {r.text for r in held_out}
    positives = sum(r.label == 1 for r in held_out)
    assert abs(positives - config.eval_size / 2) <= config.eval_size / 8


if __name__ == "__main__":
    SHIPPED_SST2.parent.mkdir(parents=True, exist_ok=True)
    SHIPPED_SST2.write_text(render(generate_sst2_small()))
    print(f"wrote {SHIPPED_SST2}")
