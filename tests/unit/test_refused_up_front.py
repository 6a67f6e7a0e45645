"""Input that cannot run is refused by `zocheck-ray train` before Ray starts: exit 2, one line naming
the file or field and what to do, no traceback, nothing written to storage."""

from __future__ import annotations

import os

import pytest

from zocheck_ray.cli import main
from zocheck_ray.control.startup import build_task_once
from zocheck_ray.config import JobConfigError, load_job_config


def refused(tmp_path, capsys, *argv: str) -> str:
    storage = tmp_path / "runs"
    assert main(["train", "--storage", str(storage), *argv]) == 2
    assert not storage.exists()  # nothing started
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from zocheck_ray.workload import build_model

    directory = tmp_path_factory.mktemp("model")
    build_model("tiny-opt").save_pretrained(directory)
    return directory


def broken_copy(saved_model, tmp_path, name):
    import shutil

    directory = tmp_path / name
    shutil.copytree(saved_model, directory)
    return directory


def test_a_truncated_weights_file_is_refused_naming_it(saved_model, tmp_path, capsys):
    directory = broken_copy(saved_model, tmp_path, "truncated")
    weights = directory / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    err = refused(tmp_path, capsys, "--set", f"model={directory}")
    assert f"model file {weights} is truncated" in err


def test_a_directory_without_weights_is_refused(saved_model, tmp_path, capsys):
    directory = broken_copy(saved_model, tmp_path, "no-weights")
    (directory / "model.safetensors").unlink()
    err = refused(tmp_path, capsys, "--set", f"model={directory}")
    assert f"model directory {directory} has no weights" in err and "save_pretrained" in err


def test_a_corrupt_config_json_is_refused_naming_it(saved_model, tmp_path, capsys):
    directory = broken_copy(saved_model, tmp_path, "bad-config")
    (directory / "config.json").write_text('{"model_type": "opt",')
    err = refused(tmp_path, capsys, "--set", f"model={directory}")
    assert f"{directory / 'config.json'} is not readable JSON" in err


def test_a_sound_model_directory_passes(saved_model):
    assert load_job_config(overrides=[f"model={saved_model}"]).model == str(saved_model)


def test_a_model_directory_without_a_tokenizer_is_refused_naming_both_fixes(saved_model, tmp_path, capsys):
    err = refused(tmp_path, capsys, "--config", str(job_file(tmp_path, f"model: {saved_model}")))
    assert err == (
        f"zocheck-ray train: task (sst2 on model '{saved_model}'): model directory {saved_model} has no tokenizer "
        "(none of tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.txt, vocab.json), and a pretrained "
        "model's text must be tokenized as it was pretrained: save its tokenizer beside it "
        f"(tokenizer.save_pretrained('{saved_model}')), or set task.tokenizer: byte to train it on byte-level ids\n")
    build_task_once(load_job_config(overrides=[f"model={saved_model}", "task.tokenizer=byte"]))  # said so: it runs


def job_file(tmp_path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(text + "\n")
    return path


def test_prefix_tuning_on_an_encoder_is_refused(tmp_path, capsys):
    err = refused(tmp_path, capsys, "--set", "model=tiny-bert", "--set", "task.kind=classification",
                  "--set", "peft.method=prefix")
    assert "peft.method=prefix needs a model whose forward takes past key values" in err and "lora" in err


def test_prefix_tokens_beyond_learned_positions_are_refused():
    with pytest.raises(JobConfigError, match="peft.num_virtual_tokens=16 plus task.max_length=64 exceed"):
        build_task_once(load_job_config(overrides=["peft.method=prefix", "task.kind=sst2"]))
    build_task_once(load_job_config(overrides=["peft.method=prefix", "task.kind=sst2", "task.max_length=48"]))


@pytest.mark.parametrize("typed, value", [("yes", "yes"), ("no", "no"), ("true", "yes"), ("off", "no")])
def test_use_gpu_takes_yaml_booleans_as_typed(tmp_path, typed, value):
    assert load_job_config(overrides=[f"scaling.use_gpu={typed}"]).scaling.use_gpu == value
    path = tmp_path / "job.yaml"
    path.write_text(f"scaling:\n  use_gpu: {typed}\n")
    assert load_job_config(path).scaling.use_gpu == value


@pytest.mark.parametrize("item, line", [
    ("zo.lrr=1", "zo.lrr is not a field of zo; did you mean zo.lr? (zo's fields: adam_eps, betas, eps, grad_clip, lr,"),
    ("stepz=3", "stepz is not a field of the job; did you mean steps?"),
    ("zo.lr=.nan", "zo.lr=nan is not a number: give a finite value"),
    ("run_id=123", "run_id=123 must be a string: quote it, e.g. --set 'run_id=\"123\"'"),
    ("scaling.use_gpu=maybe", "scaling.use_gpu='maybe' must be 'auto', 'yes' or 'no'"),
    ("shadow=3", "shadow=3 must be a section of fields"),
    ("=3", "--set '=3': the field before '=' is blank"),
])
def test_config_errors_are_one_line_naming_the_field(tmp_path, capsys, item, line):
    assert line in refused(tmp_path, capsys, "--set", item)


def test_local_storage_without_room_for_two_snapshots_is_refused_before_ray(small_disk, tmp_path, capsys):
    from zocheck_ray.control.startup import STORAGE_MARGIN_BYTES, snapshot_bytes

    job = load_job_config(storage=str(small_disk.path / "runs"))
    needed = 2 * snapshot_bytes(job) + STORAGE_MARGIN_BYTES
    small_disk.fill(leave=needed - 4096)  # room for the lease, not for the run's snapshots
    assert main(["train", "--storage", str(small_disk.path / "runs"), "--set", "run_id=full"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{small_disk.path / 'runs' / 'full'} has" in err and f"this run needs {needed}" in err
    assert "free space there or choose another --storage" in err


def test_a_shadow_waiting_on_a_full_disk_says_so_instead_of_waiting_out_its_timeout(small_disk):
    from support import trained
    from zocheck_ray.config import JobConfig
    from zocheck_ray.runtime.shadow import Shadow
    from zocheck_ray.runtime.errors import StageError

    job = JobConfig(storage=str(small_disk.path), shadow={"snapshot_interval": 4})
    initial, _, _ = trained(job, 0)
    shadow = Shadow(job)  # its lease is written; then no room is left for its first snapshot
    try:
        small_disk.fill(leave=0)
        with pytest.raises(StageError, match=r"the initial image could not be made durable: storage is full "
                                             r"\(StorageFullError: .*\(ENOSPC\)"):
            shadow.initialize(0, initial, timeout=600)
        assert shadow.persist.full
    finally:
        small_disk.free()
        assert shadow.close()  # space again: the lease is released


def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    err = refused(tmp_path, capsys, "--json", str(tmp_path / "file" / "summary.json"))
    assert f"--json {tmp_path / 'file' / 'summary.json'}: {tmp_path / 'file'} is not an existing directory" in err
    assert "is a directory; name a file" in refused(tmp_path, capsys, "--json", str(tmp_path))


def test_a_bad_fail_at_is_refused_before_the_plan_is_printed(tmp_path, capsys):
    storage = tmp_path / "runs"
    assert main(["train", "--storage", str(storage), "--fail-at", "3"]) == 2
    out, err = capsys.readouterr()
    assert "falls in the startup profile" in err and "injected trainer failure" not in out
    assert not storage.exists()


def test_config_reference_check_of_a_missing_file_is_one_line(tmp_path, capsys):
    assert main(["config-reference", "--check", str(tmp_path / "nope.md")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nope.md'} does not exist" in err and len(err.strip().splitlines()) == 1


def test_verify_and_recover_say_nothing_is_there_with_exit_2(tmp_path, capsys):
    (tmp_path / "run" / "snapshots").mkdir(parents=True)
    assert main(["verify", str(tmp_path / "run")]) == 2
    out, err = capsys.readouterr()
    assert "MISMATCH" not in out + err and "nothing to verify: no committed snapshot under" in err
    assert main(["recover", "--storage", str(tmp_path / "missing")]) == 2
    assert main(["recover", "--storage", str(tmp_path / "run")]) == 2
