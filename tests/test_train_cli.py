"""`zocheck-ray train`: bad job input is refused before any actor, and the embedded default
job runs end to end on a real local Ray: one injected trainer failure, an automatic
recovery, the durable log replayed and compared with every step, the final table.
"""

from __future__ import annotations

import json

import pytest
import ray

from zocheck_ray.cli import main
from zocheck_ray.config import JobConfig, JobConfigError, load_job_config
from zocheck_ray.controller import run


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


def test_controller_refuses_a_bad_task_before_ray(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS + [{"sentence": "so so", "label": 7}])
    job = JobConfig(task={"data_path": path, "eval_size": 2}, storage=str(tmp_path / "runs"))
    with pytest.raises(JobConfigError, match="label 7 is not in the verbalizer"):
        run(job, progress=None)
    assert not ray.is_initialized() and not (tmp_path / "runs").exists()


@pytest.fixture(scope="module")
def local_ray():
    # address="local": a new instance of its own, even where another `ray start` cluster runs on this machine
    ray.init(address="local", num_cpus=3, namespace="zocheck", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


STEPS = 40


def test_embedded_default_fails_recovers_verifies_and_prints_the_table(local_ray, tmp_path, capsys):
    out = tmp_path / "summary.json"
    assert main(["train", "--steps", str(STEPS), "--storage", str(tmp_path / "runs"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "no --config: the embedded default job" in text
    assert f"injected trainer failure at step [{round(0.6 * STEPS)}]" in text
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
    assert table["durable log replay"].startswith(f"verified: {STEPS} records replayed")

    doc = json.loads(out.read_text())
    assert doc["steps"] == STEPS and doc["final_state_hash"] == doc["shadow_state_hash"]
    assert doc["verification"]["verified"] and doc["verification"]["mismatches"] == []
    assert doc["verification"]["recovery_image_step"] == STEPS
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
