"""No silent fallback in sampling: a sampler asked for more rows than its file has takes every row there is, and
says so with the numbers, in the run's start lines and in its summary's warnings."""

from __future__ import annotations

import json

import pytest

from test_controller import FakeParts
from zocheck_ray.config import JobConfig
from zocheck_ray.control.callbacks import ProgressPrinter
from zocheck_ray.control.controller import Controller
from zocheck_ray.train_cli import result_table
from zocheck_ray.workload import TaskConfig, build_task

ROWS = [{"sentence": f"film {i} was {'good' if i < 9 else 'bad'}", "label": int(i < 9)} for i in range(39)]
"""9 rows of label 1, 30 of label 0."""


@pytest.fixture
def files(tmp_path):
    train, held = tmp_path / "train.jsonl", tmp_path / "dev.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    held.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    return str(train), str(held)


def test_k_shot_beyond_a_labels_rows_takes_them_all_and_says_so(files):
    train, held = files
    task = build_task(TaskConfig(data_path=train, eval_path=held, k_shot=16), "tiny-opt")
    assert task.n_train == 25
    assert task.warnings == [f"task.k_shot=16 asks for 16 training rows per label, but {train} has 9 of label 1: "
                             "25 training rows, not 32"]


def test_mezos_sampler_beyond_the_files_rows_says_what_it_drew(files):
    train, held = files
    task = build_task(TaskConfig(data_path=train, eval_path=held, num_train=30, num_dev=20, num_eval=8), "tiny-opt")
    assert (task.n_train, len(task.dev_examples), task.n_eval) == (19, 20, 4)
    assert task.warnings == [
        f"task.num_train=30 and task.num_dev=20 draw 50 rows, but {train} has 39 training rows: 19 train and 20 dev",
        f"task.num_eval=8 draws 8 held-out rows, but {held} has 4: all 4 evaluated"]


def test_an_eval_size_beyond_the_held_out_file_says_so_and_its_default_does_not(files):
    train, held = files
    asked = build_task(TaskConfig(data_path=train, eval_path=held, eval_size=10), "tiny-opt")
    assert asked.warnings == [f"task.eval_size=10 asks for 10 held-out rows, but {held} has 4: all 4 evaluated"]
    assert build_task(TaskConfig(data_path=train, eval_path=held), "tiny-opt").warnings == []  # 96 by default
    assert build_task(TaskConfig(data_path=train, eval_path=held, k_shot=9), "tiny-opt").warnings == []


def test_the_start_lines_and_the_summary_carry_the_shortfall(files, tmp_path):
    train, held = files
    job = JobConfig(run_id="short", steps=5, log_interval=5, shadow={"snapshot_interval": 4}, storage=str(tmp_path),
                    task={"data_path": train, "eval_path": held, "k_shot": 16})
    task = build_task(job.task, job.model)
    lines: list[str] = []
    summary = Controller(job, task, FakeParts(job), callbacks=[ProgressPrinter(lines.append)]).run()
    warning = (f"task.k_shot=16 asks for 16 training rows per label, but {train} has 9 of label 1: 25 training rows, "
               "not 32")
    assert lines[1].startswith("  task sst2: 25 training rows, 4 held-out rows") and lines[2] == f"  warning: {warning}"
    assert summary.warnings == [f"step 0: {warning}"]
    assert dict(result_table(summary))["warnings"] == f"step 0: {warning}"
