"""MeZO's tasks from local files: every task from JSONL, Parquet and a `save_to_disk` folder the tests write,
MeZO's prompt templates and verbalizers, k-shot sampling, the metrics (accuracy; SQuAD's F1), and errors
that name the file, row and field. Nothing is downloaded."""

import json

import datasets
import pytest
import torch

from zocheck_ray.control.startup import build_task_once
from zocheck_ray.config import JobConfigError, load_job_config
from zocheck_ray.core import ZOConfig, ZOOptimizer
from zocheck_ray.testing.in_process import run_in_process
from zocheck_ray.testing.reference import uninterrupted_hashes
from zocheck_ray.workload import TaskConfig, build_model, build_task, trainable_parameters
from zocheck_ray.workload.errors import DataFileError, DataFormatError, LabelError
from zocheck_ray.workload.prompts import TEMPLATES, Rendered
from zocheck_ray.workload.rows import READERS
from zocheck_ray.workload.sampling import k_shot
from zocheck_ray.workload.tasks import f1_score, normalize_answer

ROWS = 24

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: see conftest
CLASSES = {"rte": 2, "cb": 3, "boolq": 2, "wsc": 2, "wic": 2, "multirc": 2, "copa": 2, "squad": 1, "sst2": 2}


def record(kind: str, i: int) -> dict:
    """Row i of a small dataset with the fields `datasets` gives the SuperGLUE / SQuAD tasks."""
    label = i % CLASSES[kind]
    word = ["red", "blue", "green", "tall", "fast", "old"][i % 6]
    if kind in ("rte", "cb"):
        return {"premise": f"The {word} car {i} is parked.", "hypothesis": f"A car is {word}.", "label": label}
    if kind == "boolq":
        return {"passage": f"The sky over town {i} is {word}.", "question": f"is the sky {word}", "label": label}
    if kind == "wsc":
        return {"text": f"Mark told Pete {i} that he was {word}.", "span1_text": "Mark", "span2_text": "He",
                "label": label}
    if kind == "wic":
        return {"word": word, "sentence1": f"A {word} bank {i}.", "sentence2": f"The {word} river.", "label": label}
    if kind == "multirc":
        return {"paragraph": f"Ann has {i} {word} cats.", "question": "What does Ann have?", "answer": "cats",
                "label": label}
    if kind == "copa":
        return {"premise": f"The glass {i} broke.", "choice1": "It fell.", "choice2": f"It was {word}.",
                "question": "cause" if i % 2 else "effect", "label": label}
    if kind == "squad":
        return {"title": "Colors", "context": f"Item {i} is {word}.", "question": f"What color is item {i}?",
                "answers": {"text": [word], "answer_start": [10]}}
    return {"sentence": f"a {word} film number {i}", "label": label}


def write(tmp_path, kind: str, fmt: str) -> str:
    rows = [record(kind, i) for i in range(ROWS)]
    if fmt == "jsonl":
        path = tmp_path / f"{kind}.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    elif fmt == "parquet":
        path = tmp_path / f"{kind}.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:  # a DatasetDict saved with save_to_disk: train and validation splits
        path = tmp_path / f"{kind}_saved"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:18]),
                              "validation": datasets.Dataset.from_list(rows[18:])}).save_to_disk(str(path))
    return str(path)


def config(kind, path, **kw):
    fields = dict(kind=kind, data_path=path, batch_size=4, max_length=64, eval_size=6, eval_batch_size=4)
    if kind == "sst2":
        fields["text_field"] = "sentence"
    fields.update(kw)
    return TaskConfig(**fields)


KINDS = ["rte", "cb", "boolq", "wsc", "wic", "multirc", "copa", "squad", "sst2"]


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-opt")  # evaluation only reads it


@pytest.mark.parametrize("kind", KINDS)
def test_every_task_reads_jsonl_parquet_and_a_saved_dataset(tmp_path, kind):
    """The same rows as JSONL and as Parquet give the same examples; a `save_to_disk` folder's splits are the
    training and held-out rows."""
    from_jsonl = build_task(config(kind, write(tmp_path, kind, "jsonl")), "tiny-opt")
    from_parquet = build_task(config(kind, write(tmp_path, kind, "parquet")), "tiny-opt")
    assert (from_jsonl.n_train, from_jsonl.n_eval) == (ROWS - 6, 6)
    assert from_parquet.train_examples == from_jsonl.train_examples
    assert from_parquet.eval_examples == from_jsonl.eval_examples
    saved = build_task(config(kind, write(tmp_path, kind, "dataset")), "tiny-opt")
    train, held_out = tmp_path / "train.jsonl", tmp_path / "validation.jsonl"
    train.write_text("".join(json.dumps(record(kind, i)) + "\n" for i in range(18)))
    held_out.write_text("".join(json.dumps(record(kind, i)) + "\n" for i in range(18, ROWS)))
    as_files = build_task(config(kind, str(train), eval_path=str(held_out)), "tiny-opt")
    assert (saved.n_train, saved.n_eval) == (18, 6)
    assert saved.train_examples == as_files.train_examples and saved.eval_examples == as_files.eval_examples


@pytest.mark.parametrize("kind", KINDS)
def test_every_task_has_a_loss_and_its_metric(tmp_path, kind, model):
    task = build_task(config(kind, write(tmp_path, kind, "jsonl"), eval_size=3), "tiny-opt")
    loss = task.loss(model, task.batch(0))
    assert torch.isfinite(loss) and loss > 0
    metrics = task.evaluate(model)
    if kind == "squad":
        assert task.metric == "f1" and 0.0 <= metrics["f1"] <= 1.0 and 0.0 <= metrics["exact_match"] <= 1.0
    else:
        assert task.metric == "accuracy" and metrics["accuracy"] in (0.0, 1 / 3, 2 / 3, 1.0)
    assert metrics["loss"] > 0


def rendered(kind: str, record: dict) -> Rendered:
    """One record through the rows and render stages."""
    fields, label = READERS[kind](record, ("f", 1))
    return Rendered(*TEMPLATES[kind](fields), label, "f", 1)


def test_mezo_s_templates_and_verbalizers():
    rte = rendered("rte", {"premise": "It rains.", "hypothesis": "It is wet.", "label": "entailment"})
    assert rte.prompt == 'It rains.\nDoes this mean that "It is wet." is true? Yes or No?\n'
    assert rte.options == ("Yes", "No") and rte.label == 0
    cb = rendered("cb", {"premise": "It rains.", "hypothesis": "It is wet.", "label": "neutral"})
    assert cb.prompt == 'Suppose It rains. Can we infer that "It is wet."? Yes, No, or Maybe?\n'
    assert cb.options == ("Yes", "No", "Maybe") and cb.label == 2
    boolq = rendered("boolq", {"passage": "Cats purr.", "question": "do cats purr", "label": True})
    assert boolq.prompt == "Cats purr. Do cats purr?\n" and boolq.options == ("Yes", "No") and boolq.label == 0
    answer = rendered("boolq", {"passage": "P.", "question": "is it?", "answer": False})  # `boolq`'s fields
    assert answer.prompt == "P. Is it?\n" and answer.label == 1
    copa = rendered("copa", {"premise": "The man fell.", "choice1": "He slipped.", "choice2": "He won.",
                             "question": "cause", "label": 0})
    assert copa.prompt == "The man fell because " and copa.options == ("he slipped.", "he won.")
    effect = rendered("copa", {"premise": "I was cold!", "choice1": "I shivered.", "choice2": "Ann LEFT.",
                               "question": "effect", "label": 0})
    assert effect.prompt == "I was cold! so " and effect.options == ("I shivered.", "ann LEFT.")
    wsc = rendered("wsc", {"text": "Tom said he ran.", "span1_text": "Tom", "span2_text": "He", "label": 1})
    assert wsc.prompt.endswith('does the pronoun "he" refer to Tom? Yes or No?\n') and wsc.options == ("No", "Yes")
    wic = rendered("wic", {"word": "bank", "sentence1": "s1", "sentence2": "s2", "label": 0})
    assert wic.prompt == 'Does the word "bank" have the same meaning in these two sentences? Yes, No?\ns1\ns2\n'


def test_k_shot_takes_k_per_class_with_the_seed(tmp_path):
    path = write(tmp_path, "cb", "jsonl")
    task = build_task(config("cb", path, k_shot=2, eval_size=3), "tiny-opt")
    assert task.n_train == 6 and sorted(ex.label for ex in task.train_examples) == [0, 0, 1, 1, 2, 2]
    again = build_task(config("cb", path, k_shot=2, eval_size=3), "tiny-opt")
    assert again.train_examples == task.train_examples
    other = build_task(config("cb", path, k_shot=2, eval_size=3, data_seed=5), "tiny-opt")
    assert other.train_examples != task.train_examples
    rows = [(i, {"x": i, "label": i % 2}) for i in range(10)]
    picked = k_shot(rows, 3, 0, lambda row: row[1]["label"])
    assert [line for line, _ in picked] == sorted(line for line, _ in picked)  # file order kept
    sst2 = build_task(config("sst2", write(tmp_path, "sst2", "parquet"), k_shot=4), "tiny-opt")
    assert sst2.n_train == 8


def test_squad_f1_and_exact_match():
    assert normalize_answer("The  Blue, sky!") == "blue sky"
    assert f1_score("the blue sky", "Blue sky") == 1.0
    assert f1_score("blue", "blue sky") == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    assert f1_score("red", "blue") == 0.0


def test_a_mezo_task_trains_and_its_run_is_reproducible(tmp_path):
    path = write(tmp_path, "rte", "parquet")
    job = load_job_config(overrides=[f"storage={tmp_path}", "steps=4", "task.kind=rte", f"task.data_path={path}",
                                     "task.batch_size=4", "task.max_length=64", "task.eval_size=4", "task.k_shot=4",
                                     "zo.lr=1e-2", "zo.eps=1e-2"])
    first, second = uninterrupted_hashes(job), uninterrupted_hashes(job)
    assert first == second and len(set(first.values())) == 5
    task = build_task(job.task, job.model)
    model = build_model(job.model)
    opt = ZOOptimizer(trainable_parameters(model), ZOConfig(lr=1e-2, eps=1e-2))
    opt.step(task.closure(model, 0), seed=1)
    assert opt.last_losses is not None


def test_a_squad_run_with_a_prefix_adapter_reports_f1_at_every_eval_interval_and_survives_a_failure(tmp_path):
    """The trainer evaluates the held-out rows (greedy answers through peft's prefix model) at step 0, every
    eval_interval steps and the last; a software failure in between changes no hash."""
    job = load_job_config(overrides=[
        f"storage={tmp_path / 'run'}", "steps=5", "shadow.snapshot_interval=2", "durability.durable_interval=2",
        "log_interval=2",
        "hash_every_step=true", "task.kind=squad", f"task.data_path={write(tmp_path, 'squad', 'jsonl')}",
        "task.batch_size=2", "task.max_length=62", "task.eval_size=2", "task.eval_interval=2", "task.k_shot=8",
        "peft.method=prefix", "peft.num_virtual_tokens=2", "zo.lr=1e-2", "zo.eps=1e-2"])
    run = run_in_process(job, software=[3])
    assert sorted(run.evaluations) == [0, 2, 4, 5]
    for metrics in run.evaluations.values():
        assert set(metrics) == {"f1", "exact_match", "loss"} and 0.0 <= metrics["f1"] <= 1.0
    expected = uninterrupted_hashes(job)
    assert all(set(seen) == {expected[step]} for step, seen in run.step_hashes.items())
    assert run.shadow == (5, expected[5])


def test_bad_data_names_the_file_the_row_and_the_field(tmp_path):
    path = tmp_path / "rte.jsonl"
    path.write_text(json.dumps(record("rte", 0)) + "\n" + json.dumps({"premise": "p", "label": 0}) + "\n")
    with pytest.raises(DataFormatError, match=r"rte.jsonl:2: missing field 'hypothesis'"):
        build_task(config("rte", str(path), eval_size=1), "tiny-opt")
    path.write_text("\n".join(json.dumps({**record("rte", i), "label": 7}) for i in range(4)))
    with pytest.raises(LabelError, match="label 7"):
        build_task(config("rte", str(path), eval_size=1), "tiny-opt")
    squad = tmp_path / "squad.jsonl"
    squad.write_text(json.dumps({"context": "c", "question": "q", "answers": {"text": []}}) + "\n")
    with pytest.raises(DataFormatError, match="answers"):
        build_task(config("squad", str(squad), eval_path=str(squad), eval_size=1), "tiny-opt")
    saved = write(tmp_path, "wic", "dataset")
    with pytest.raises(DataFileError, match="splits"):
        build_task(config("wic", saved, split="dev"), "tiny-opt")
    with pytest.raises(JobConfigError, match="data_path"):
        load_job_config(overrides=["task.kind=copa"])
    with pytest.raises(JobConfigError, match="k_shot"):
        load_job_config(overrides=["task.kind=lm", "task.k_shot=4"])
    with pytest.raises(JobConfigError, match="causal LM"):
        build_task_once(load_job_config(overrides=["model=tiny-bert", "task.kind=boolq",
                                                   f"task.data_path={write(tmp_path, 'boolq', 'jsonl')}"]))
