"""`zocheck-ray train`: bad job input is refused before any actor, and the embedded default
job runs end to end on a real local Ray: one injected trainer failure, an automatic
recovery, the durable log replayed and compared with every step, the final table.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import ray

from conftest import slow_fixture
from zocheck_ray.cli import main
from zocheck_ray.config import RAY_JOB_ENV, JobConfig, JobConfigError, check_job_environment, load_job_config
from zocheck_ray.testing import run_with_faults as run


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


ROWS = [{"sentence": f"film number {i} was {'good' if i % 2 else 'bad'}", "label": i % 2} for i in range(12)]


def refused(tmp_path, capsys, *sets: str) -> str:
    """Run `train` with these `--set`s; it must exit 2 before creating the run's storage."""
    storage = tmp_path / "runs"
    argv = ["train", "--storage", str(storage)]
    for item in sets:
        argv += ["--set", item]
    assert main(argv) == 2
    assert not storage.exists()  # nothing started
    return capsys.readouterr().err


def test_missing_model_directory_is_refused(tmp_path, capsys):
    err = refused(tmp_path, capsys, f"model={tmp_path / 'no-such-model'}")
    assert "model" in err and str(tmp_path / "no-such-model") in err and "existing directory" in err


def test_malformed_row_is_named_by_file_and_line(tmp_path, capsys):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS[:4] + ['{"sentence": "broken", "label": '] + ROWS[4:])
    err = refused(tmp_path, capsys, f"task.data_path={path}", "task.eval_size=2")
    assert f"{path}:5:" in err


def test_label_outside_the_verbalizer_is_named(tmp_path, capsys):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS + [{"sentence": "so so", "label": 7}])
    err = refused(tmp_path, capsys, f"task.data_path={path}", "task.eval_size=2", "task.kind=sst2")
    assert f"{path}:13:" in err and "label 7 is not in the verbalizer" in err


def test_task_model_mismatch_is_refused(tmp_path, capsys):
    err = refused(tmp_path, capsys, "task.kind=classification", "model=tiny-opt")
    assert "task kind 'classification' needs a model with a classification head" in err
    err = refused(tmp_path, capsys, "task.kind=sst2", "model=tiny-bert")
    assert "task kind 'sst2' needs a causal LM" in err


def test_moved_fields_say_where_they_live(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("steps: 10\nbatch_size: 8\n")
    with pytest.raises(JobConfigError, match="batch_size is no longer a job field: set task.batch_size"):
        load_job_config(config)


def test_an_old_flat_field_is_refused_by_train_with_one_line(tmp_path, capsys):
    err = refused(tmp_path, capsys, "shadow_cpus=2")
    assert err == \
        "zocheck-ray train: shadow_cpus is no longer a job field: set shadow.cpus (one place for each setting)\n"
    config = tmp_path / "old.yaml"
    config.write_text("steps: 10\nstandby: true\n")
    assert main(["train", "--config", str(config), "--storage", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err == \
        "zocheck-ray train: standby is no longer a job field: set failure.standby (one place for each setting)\n"


def test_controller_refuses_a_bad_task_before_ray(tmp_path, without_local_ray):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS + [{"sentence": "so so", "label": 7}])
    job = JobConfig(task={"data_path": path, "eval_size": 2}, storage=str(tmp_path / "runs"))
    with pytest.raises(JobConfigError, match="label 7 is not in the verbalizer"):
        run(job, progress=None)
    assert not ray.is_initialized() and not (tmp_path / "runs").exists()


STEPS = 40


def test_embedded_default_fails_recovers_verifies_and_prints_the_table(local_ray, tmp_path, capsys):
    out = tmp_path / "summary.json"
    assert main(["train", "--steps", str(STEPS), "--storage", str(tmp_path / "runs"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "no --config: the embedded default job" in text
    assert f"  injected trainer failure at step {round(0.6 * STEPS)}\n" in text
    assert "held-out loss" in text  # the progress lines carry the evaluations
    assert text.rstrip().splitlines()[-2] == "verified"
    table = dict(line.strip().split("  ", 1) for line in text.splitlines()
                 if line.startswith("  ") and "  " in line.strip())
    table = {k.strip(): v.strip() for k, v in table.items()}
    for row in ("steps", "held-out before (step 0)", f"held-out after (step {STEPS})", "publish overhead per step",
                "lag (steps)", "snapshots taken / persisted", "recoveries", "durable log replay"):
        assert row in table, row
    assert table["steps"] == str(STEPS)
    assert "from the memory image" in table["recoveries"]
    # the loss at the end of the first and the last segment, each named by its step
    losses = re.fullmatch(r"(\S+) \(step (\d+)\) -> (\S+) \(step (\d+)\)", table["training loss"])
    assert losses and int(losses[2]) < int(losses[4]) == STEPS, table["training loss"]
    assert table["durable log replay"].startswith(f"verified: {STEPS} records replayed")

    doc = json.loads(out.read_text())
    assert doc["steps"] == STEPS and doc["final_state_hash"] == doc["shadow_state_hash"]
    assert doc["verification"]["verified"] and doc["verification"]["mismatches"] == []
    assert doc["verification"]["recovery_image_step"] == STEPS
    assert doc["verification"]["proven_to_step"] == STEPS and f"..{STEPS} proven:" in doc["verification"]["audit"]
    (recovery,) = doc["recoveries"]
    assert recovery["failed_at_step"] == round(0.6 * STEPS) and recovery["image_source"] == "memory"
    # Held-out evaluation before and after; the language-modelling loss falls over the run.
    assert {"0", str(STEPS)} <= set(doc["evaluations"])
    assert doc["metric"] == "loss"
    assert doc["metric_before"] == doc["evaluations"]["0"]["loss"]
    assert doc["metric_after"] == doc["evaluations"][str(STEPS)]["loss"]
    assert doc["metric_after"] < doc["metric_before"] - 0.1
    snapshots_taken, snapshots_persisted = (int(x) for x in table["snapshots taken / persisted"].split(" / "))
    assert snapshots_taken == doc["metrics"]["snapshots_taken"] >= 1
    assert snapshots_persisted == doc["metrics"]["snapshots_persisted"] >= 1


# ---------------------------------------------------------------------- storage input (issue 12)


@pytest.mark.parametrize("storage, message", [
    ("s3://", "names no bucket"),
    ("s3:///runs", "names no bucket"),
    ("s3:/bucket/runs", "without its '//'"),
    ("gs://bucket/runs", "unsupported storage URL scheme 'gs'"),
    ("s3a://bucket/runs", "write s3://"),
    ("s3://bucket/../runs", "'.' and '..' are not directories on S3"),
    ("memory://runs", "memory:// lives inside one process"),
], ids=["no-bucket", "empty-bucket", "one-slash", "gs", "s3a", "dotdot", "memory"])
def test_an_unusable_storage_url_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch, storage,
                                                                      message):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--storage", storage, "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "storage" in err and message in err
    assert os.listdir(tmp_path) == []  # no local directory named "s3:" or the like


@pytest.mark.parametrize("run_id", ["..", ".", "a/b", "a\\b", ".hidden", "run 1"])
def test_a_run_id_that_is_not_a_plain_name_is_refused(tmp_path, capsys, run_id):
    err = refused(tmp_path, capsys, f"run_id={run_id}")
    assert "run_id" in err and ("plain name" in err or "must not start with '.'" in err)


def test_a_run_id_with_a_control_character_is_refused(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text('run_id: "run\\u0001x"\nsteps: 5\n')
    with pytest.raises(JobConfigError, match="run_id .* control characters"):
        load_job_config(config)
    with pytest.raises(JobConfigError, match="run_id must be a non-empty plain name"):
        load_job_config(overrides=["run_id=''"])


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n"], ids=["empty", "comment-only"])
def test_an_empty_job_file_is_refused_not_run_as_the_default(tmp_path, capsys, text):
    config = tmp_path / "job.yaml"
    config.write_text(text)
    with pytest.raises(JobConfigError, match=r"job.yaml is empty: write the job's fields"):
        load_job_config(config)
    assert main(["train", "--config", str(config), "--storage", str(tmp_path / "runs")]) == 2
    assert "is empty" in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_a_job_file_that_is_not_a_mapping_is_refused(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("- steps: 5\n")
    with pytest.raises(JobConfigError, match="must hold a mapping of job fields"):
        load_job_config(config)


SUBMITTED = json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_0123.zip"},
                        "metadata": {"job_submission_id": "raysubmit_abc123"}})


def test_a_relative_storage_path_in_a_submitted_job_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(RAY_JOB_ENV, SUBMITTED)  # what Ray's job supervisor sets for the entrypoint
    assert main(["train", "--storage", "runs", "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "storage='runs' is a relative path" in err and "raysubmit_abc123" in err
    assert "absolute path" in err and "s3://" in err
    assert os.listdir(tmp_path) == []


def test_absolute_and_s3_storage_pass_the_submitted_job_check(tmp_path):
    environ = {RAY_JOB_ENV: SUBMITTED}
    check_job_environment(JobConfig(storage=str(tmp_path / "runs")), environ)
    check_job_environment(JobConfig(storage="s3://bucket/runs"), environ)
    check_job_environment(JobConfig(storage="./runs"), {})  # not a submitted job: a local run may use one


def test_the_run_url_keeps_the_storage_urls_slashes():
    assert JobConfig(storage="s3://bucket/", run_id="r1").run_url == "s3://bucket/r1"
    assert JobConfig(storage="s3://bucket/runs", run_id="r1").run_url == "s3://bucket/runs/r1"
    assert JobConfig(storage="/data/runs/", run_id="r1").run_url == "/data/runs/r1"
