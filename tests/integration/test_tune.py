"""Ray Tune: one ZOCheck job per trial; checkpoints are pointers; a restored trial resumes exactly.

One two-trial sweep over the learning rate for the module; the second trial fails once
after its first checkpoints and Tune restores it. Both must end with the state of the
plain uninterrupted loop (`reference_runs.uninterrupted_hashes`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from conftest import slow_fixture
from reference_runs import SMALL_TASK, uninterrupted_hashes
from support import REPO

from zocheck_ray.config import JobConfig, JobConfigError
from zocheck_ray.storage import SnapshotStore
from zocheck_ray.testing import FailTrialOnce
from zocheck_ray.tune import (
    POINTER_FILE, CheckpointPointer, CheckpointPointerError, TrialResourcesError, _grid_entry,
    check_cluster_fits_a_trial, check_pointer, format_table, read_pointer, summarize, sweep, trial_resources,
    write_pointer,
)

STEPS = 16
FAIL_AT = 8
LRS = [2e-3, 5e-3]


RAY_CPUS = 6
"""Logical CPUs the local Ray instance has at least (`conftest.local_ray`): trials run side by side."""


@slow_fixture(scope="module")  # a two-trial sweep with a restored trial
def results(tmp_path_factory, local_ray):
    root = tmp_path_factory.mktemp("tune")
    job = JobConfig(run_id="sweep", steps=STEPS, shadow={"snapshot_interval": 4}, log_interval=4,
                    storage=str(root / "runs"),
                    task={**SMALL_TASK, "eval_interval": 8}, zo={"lr": LRS[0], "eps": 1e-3})
    fail_second = FailTrialOnce(FAIL_AT, marker_dir=str(root), matches=lambda trial: trial.zo.lr == LRS[1])
    grid = sweep(job, {"zo.lr": LRS}, callbacks=[fail_second], tune_storage=str(root / "tune"),
                 name="lr-sweep")
    return job, list(grid)


@functools.cache
def reference_hash(lr: float) -> str:
    """The final state_hash of the plain uninterrupted loop (no Ray, no Tune) at this lr."""
    job = JobConfig(steps=STEPS, task={**SMALL_TASK, "eval_interval": 8}, zo={"lr": lr, "eps": 1e-3})
    return uninterrupted_hashes(job)[STEPS]


def by_lr(results) -> dict[float, object]:
    return {r.config["zo.lr"]: r for r in results}


@pytest.mark.ray_range
def test_each_trial_runs_one_exact_job_with_its_hyperparameters(results):
    job, trials = results
    assert sorted(by_lr(trials)) == LRS
    for lr, result in by_lr(trials).items():
        assert result.error is None
        m = result.metrics
        assert m["step"] == STEPS
        assert m["exact"] is True and m["final_state_hash"] == m["shadow_state_hash"]
        assert m["run_id"].startswith("sweep-")
        assert m["final_state_hash"] == reference_hash(lr)
    assert len({r.metrics["run_id"] for r in trials}) == 2


def test_metrics_are_reported_after_every_segment(results):
    _, trials = results
    history = by_lr(trials)[LRS[0]].metrics_dataframe
    steps = [int(s) for s in history["step"]]
    assert steps == list(range(4, STEPS + 1, 4)) + [STEPS]  # each segment, then the final report
    for column in ("loss", "lag_steps", "durable_step", "replayed_step", "eval_accuracy"):
        assert column in history.columns


def test_the_first_report_carries_every_metric_a_trial_can_be_asked_for(results):
    """`--metric eval_accuracy` (or any held-out metric) is in the first report already: the step-0 evaluation,
    which Tune's metric check and its schedulers read from the first result on."""
    _, trials = results
    assert int(by_lr(trials)[LRS[0]].metrics_dataframe.iloc[0]["step"]) == 4
    for result in trials:  # the restored trial's history may start at its restore: its first report carries them too
        first = result.metrics_dataframe.iloc[0]
        assert 0.0 <= first["eval_accuracy"] <= 1.0 and first["eval_loss"] > 0, first


def test_checkpoint_is_a_json_pointer_to_the_durable_image(results):
    job, trials = results
    for result in trials:
        with result.checkpoint.as_directory() as directory:
            files = sorted(p.name for p in Path(directory).iterdir())
            assert files == [POINTER_FILE]  # no weights, no pickle
            raw = (Path(directory) / POINTER_FILE).read_text()
            assert len(raw) < 1024
            json.loads(raw)
            pointer = read_pointer(directory)
        assert pointer.run_id == result.metrics["run_id"]
        assert pointer.storage == job.storage and Path(pointer.storage).is_absolute()
        latest = SnapshotStore(pointer.run_url, create=False).latest()
        assert pointer.step == latest.step == STEPS
        assert pointer.state_hash == latest.state_hash == result.metrics["final_state_hash"]


def test_restored_trial_resumes_exactly(results):
    job, trials = results
    uninterrupted, restored = by_lr(trials)[LRS[0]], by_lr(trials)[LRS[1]]
    assert uninterrupted.metrics["resumed_from_step"] == -1
    # the failed trial came back from its durable image (the run it had started), not from scratch
    assert 0 <= restored.metrics["resumed_from_step"] <= FAIL_AT
    assert list(restored.metrics_dataframe["run_id"].unique()) == [restored.metrics["run_id"]]  # one run
    assert restored.metrics["final_state_hash"] == reference_hash(LRS[1])


def test_the_sweep_table_has_one_exact_row_per_trial(results):
    _, trials = results
    rows = summarize(trials, ["zo.lr"], "eval_accuracy")
    assert sorted(r["zo.lr"] for r in rows) == LRS
    for row in rows:
        assert row["exact"] is True and row["error"] is None and row["step"] == STEPS
        assert row["state_hash"] == reference_hash(row["zo.lr"])
        assert 0.0 <= row["eval_accuracy"] <= 1.0
    json.dumps(rows)  # what --json writes


def test_a_stale_or_foreign_pointer_is_rejected(results, tmp_path):
    _, trials = results
    with trials[0].checkpoint.as_directory() as directory:
        pointer = read_pointer(directory)
    wrong_hash = CheckpointPointer(**{**pointer.model_dump(), "state_hash": "0" * 64})
    with pytest.raises(CheckpointPointerError, match="state_hash"):
        check_pointer(wrong_hash, {})
    future = CheckpointPointer(**{**pointer.model_dump(), "step": STEPS + 8})
    with pytest.raises(CheckpointPointerError, match=f"step {STEPS + 8}"):
        check_pointer(future, {})
    (tmp_path / POINTER_FILE).write_text('{"storage": "/x", "run_id": "r", "step": 1, "weights": "..."}')
    with pytest.raises(CheckpointPointerError, match=POINTER_FILE):
        read_pointer(tmp_path)
    with pytest.raises(CheckpointPointerError, match="does not exist"):
        read_pointer(tmp_path / "empty")


def test_pointer_round_trip_holds_no_credentials(tmp_path):
    pointer = CheckpointPointer(storage="s3://bucket/runs", run_id="r-1", step=8, state_hash="a" * 64)
    write_pointer(pointer, tmp_path)
    assert read_pointer(tmp_path) == pointer
    assert set(json.loads((tmp_path / POINTER_FILE).read_text())) == {"format", "storage", "run_id", "step",
                                                                       "state_hash"}


def test_trial_reserves_controller_trainer_and_shadow_on_one_node():
    job = JobConfig(shadow={"cpus": 6})
    pgf = trial_resources(job, gpus=1)
    assert pgf.strategy == "STRICT_PACK"
    assert pgf.bundles == [{"CPU": 1}, {"CPU": 1, "GPU": 1}, {"CPU": 6}]
    assert trial_resources(job).bundles[1] == {"CPU": 1}


def test_a_bad_grid_is_rejected_before_any_trial():
    job = JobConfig(steps=10)
    with pytest.raises(JobConfigError, match="steps"):
        sweep(job, {"steps": [5, 0]})
    with pytest.raises(JobConfigError, match="learning_rate"):
        sweep(job, {"zo.learning_rate": [1e-3]})
    with pytest.raises(JobConfigError, match="at least one field"):
        sweep(job, {})


def test_grid_option_parses_values_as_yaml():
    assert _grid_entry("zo.lr=1e-3,3e-3") == ("zo.lr", [1e-3, 3e-3])
    assert _grid_entry("dtype=fp32,bf16") == ("dtype", ["fp32", "bf16"])


def test_tune_command_rejects_a_bad_grid_before_starting_ray(capsys):
    from zocheck_ray.cli import main

    config = REPO / "deploy" / "examples" / "sst2-opt.yaml"
    assert main(["tune", "--config", str(config), "--grid", "task.batch_size=8,0"]) == 2
    err = capsys.readouterr().err
    assert "zocheck-ray tune:" in err and "batch_size" in err


def node(cpus: float, gpus: float = 0, alive: bool = True) -> dict:
    """A node as `ray.nodes()` describes it (the fields the check reads)."""
    return {"Alive": alive, "Resources": {"CPU": cpus, **({"GPU": gpus} if gpus else {})}}


def test_a_two_cpu_machine_is_told_what_a_trial_is_missing_and_how_to_fix_it():
    job = JobConfig(shadow={"cpus": 1})
    with pytest.raises(TrialResourcesError) as error:
        check_cluster_fits_a_trial(job, 0, [node(2)])
    message = str(error.value)
    assert "needs 3 CPUs on one node" in message and "shadow.cpus=1" in message
    assert "has 2 CPUs" in message and "PENDING" in message
    assert "--num-cpus 3" in message and "ray start --num-cpus=3" in message
    assert "lower shadow.cpus" not in message  # already the least


def test_a_trial_must_fit_on_one_node_not_across_nodes():
    job = JobConfig(shadow={"cpus": 4})
    check_cluster_fits_a_trial(job, 0, [node(2), node(6)])
    with pytest.raises(TrialResourcesError, match="needs 6 CPUs on one node") as error:
        check_cluster_fits_a_trial(job, 0, [node(4), node(4), node(8, alive=False)])
    assert "lower shadow.cpus to 2 (--set shadow.cpus=N)" in str(error.value)


def test_a_gpu_trial_needs_the_gpu_on_the_node_with_the_cpus():
    job = JobConfig(shadow={"cpus": 2})
    check_cluster_fits_a_trial(job, 1, [node(4, gpus=1)])
    with pytest.raises(TrialResourcesError, match="4 CPUs and 1 GPU") as error:
        check_cluster_fits_a_trial(job, 1, [node(16), node(2, gpus=1)])
    assert "has 2 CPUs and 1 GPUs" in str(error.value)


def test_a_sweep_that_cannot_place_a_trial_fails_before_starting_it(results):
    job, _ = results  # the module's 6-CPU cluster
    too_big = JobConfig(**{**job.model_dump(), "run_id": "too-big", "shadow": {"cpus": 8}})
    with pytest.raises(TrialResourcesError, match="needs 10 CPUs on one node.*has 6 CPUs"):
        sweep(too_big, {"zo.lr": LRS}, tune_storage=str(Path(job.storage).parent / "tune-too-big"))


def test_tune_command_rejects_num_cpus_below_one(capsys):
    from zocheck_ray.cli import main

    assert main(["tune", "--grid", "zo.lr=1e-3", "--num-cpus", "0"]) == 2
    assert "--num-cpus must be at least 1" in capsys.readouterr().err


def test_the_final_table_fits_its_columns_and_prints_metrics_to_4_significant_digits():
    rows = [{"zo.lr": 0.001, "run_id": "sweep-4f2a9_00000", "step": 16, "eval_accuracy": 0.8123456,
             "exact": True, "state_hash": "ab" * 32, "error": None},
            {"zo.lr": 0.0031622776, "run_id": "sweep-4f2a9_00001", "step": 1200, "eval_accuracy": 1.0 / 3.0,
             "exact": False, "state_hash": None, "error": "RuntimeError: boom"}]
    lines = format_table(rows, ["zo.lr"], "eval_accuracy").splitlines()
    assert len(lines) == 3
    header = lines[0].split()
    assert header == ["zo.lr", "run_id", "step", "eval_accuracy", "exact", "state_hash"]
    first, second = lines[1].split(), lines[2].split()
    assert first == ["0.001", "sweep-4f2a9_00000", "16", "0.8123", "True", "abababababababab"]
    assert second[:6] == ["0.003162", "sweep-4f2a9_00001", "1200", "0.3333", "False", "-"]
    assert lines[2].endswith("error: RuntimeError: boom")
    # every column starts (left-aligned) or ends (numbers, right-aligned) at the same place on every line
    for column in ("run_id", "exact", "state_hash"):
        start = lines[0].index(column)
        assert all(line[start - 2:start] == "  " and line[start] != " " for line in lines[1:])
    for column in ("step", "eval_accuracy"):
        end = lines[0].index(column) + len(column)
        assert all(line[end - 1] != " " and line[end:end + 2] == "  " for line in lines[1:])
