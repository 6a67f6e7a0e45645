"""A resume is checked against the run it resumes, before Ray starts: what decides a step must match, named with
both values; a hyperparameter the step records carry may change, and the change is said and recorded."""

from __future__ import annotations

import json

import pytest

from support import trained
from zocheck_ray.cli import main
from zocheck_ray.config import JobConfig, JobConfigError
from zocheck_ray.control.identity import IDENTITY_FILE, check_identity
from zocheck_ray.control.startup import build_task_once
from zocheck_ray.runtime.shadow import Shadow


def job_of(tmp_path, **fields) -> JobConfig:
    doc = {"run_id": "r", "storage": str(tmp_path / "runs"), "shadow": {"snapshot_interval": 4},
           "zo": {"lr": 1e-3, "eps": 1e-3}, "task": {"kind": "lm", "text_field": "sentence"}, **fields}
    return JobConfig.model_validate(doc)


def started(job: JobConfig, resume_step: int | None = None, say=lambda line: None):
    check_identity(job, build_task_once(job), resume_step, say).record()


def recorded(job: JobConfig) -> dict:
    with open(f"{job.run_url}/{IDENTITY_FILE}") as f:
        return json.load(f)


def test_a_run_that_trained_nothing_takes_its_new_settings(tmp_path):
    started(job_of(tmp_path))
    started(job_of(tmp_path, dtype="bf16"), resume_step=0)  # step 0: nothing trained, the start may differ
    assert recorded(job_of(tmp_path))["dtype"] == "bf16"


@pytest.mark.parametrize("field, value, named", [
    ("dtype", "bf16", "dtype 'fp32', and this job has dtype 'bf16'"),
    ("zo", {"optimizer": "zo-adam", "lr": 1e-3, "eps": 1e-3},
     "optimizer.optimizer='zo-sgd', and this job has optimizer.optimizer='zo-adam'"),
    ("task", {"kind": "lm", "text_field": "sentence", "batch_size": 8},
     "task.batch_size=16, and this job has task.batch_size=8"),
    ("run_seed", 3, "run_seed 0, and this job has run_seed 3"),
    ("peft", {"method": "lora"}, "peft None, and this job has peft {"),
])
def test_a_resume_that_would_train_something_else_is_refused_naming_the_field_and_both_values(tmp_path, field, value,
                                                                                              named):
    started(job_of(tmp_path))
    with pytest.raises(JobConfigError) as refused:
        started(job_of(tmp_path, **{field: value}), resume_step=8)
    line = str(refused.value)
    assert "\n" not in line and f"run 'r' under {tmp_path / 'runs' / 'r'} was trained with " in line
    assert named in line and "a resume trains what its run trained" in line


def test_other_rows_are_refused_naming_both_fingerprints(tmp_path):
    first = tmp_path / "a.jsonl"
    first.write_text("".join(json.dumps({"sentence": f"row {i}"}) + "\n" for i in range(20)))
    other = tmp_path / "b.jsonl"
    other.write_text("".join(json.dumps({"sentence": f"row {i + 1}"}) + "\n" for i in range(20)))
    task = {"kind": "lm", "text_field": "sentence", "eval_size": 4}
    started(job_of(tmp_path, task={**task, "data_path": str(first)}))
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(first.read_bytes())
    started(job_of(tmp_path, task={**task, "data_path": str(moved)}), resume_step=8)  # the same rows elsewhere
    with pytest.raises(JobConfigError, match=r"was trained with data '[0-9a-f]{64}', and this job has data "
                                             r"'[0-9a-f]{64}'"):
        started(job_of(tmp_path, task={**task, "data_path": str(other)}), resume_step=8)


def test_a_changed_learning_rate_is_said_and_recorded_with_its_step(tmp_path):
    said = []
    started(job_of(tmp_path))
    started(job_of(tmp_path, zo={"lr": 1e-2, "eps": 1e-3}, task={"kind": "lm", "text_field": "sentence",
                                                                  "eval_interval": 7}), resume_step=8, say=said.append)
    assert said == ["  zo.lr changed from 0.001 to 0.01 at step 8 (the step records carry it)"]
    doc = recorded(job_of(tmp_path))
    assert doc["hyperparameters"]["lr"] == 1e-2
    assert doc["changes"] == [{"step": 8, "field": "zo.lr", "old": 1e-3, "new": 1e-2}]


def test_train_refuses_a_changed_dtype_on_an_existing_run_before_ray_starts(tmp_path, capsys, without_local_ray):
    job = job_of(tmp_path, model="tiny-opt")
    started(job)
    initial, _, records = trained(job, 8)
    shadow = Shadow(job)  # the run's storage at step 8, as a run leaves it
    shadow.initialize(0, initial)
    shadow.push(b"".join(r.to_bytes() for r in records))
    shadow.drain(8, timeout=120)
    assert shadow.close()
    config = tmp_path / "job.yaml"
    config.write_text(json.dumps(job.model_dump(mode="json")))
    assert main(["train", "--config", str(config), "--set", "dtype=bf16"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "was trained with dtype 'fp32', and this job has dtype 'bf16'" in err
