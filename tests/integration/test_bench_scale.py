"""`python -m benchmarks scale` on a real Ray instance, at its smallest size: three runs of one job
(the standby promoted, Ray's restart, the async-checkpoint baseline) that end in the same state,
and a document that reports what they measured."""

import json
import os

import pytest

import torch
import transformers

from benchmarks import scale as scale_module
from benchmarks.scale import FAIL_AT, SIZES, markdown, parameters_of, scale_benchmark, targets, too_big
from zocheck_ray.core.errors import NonFiniteError

RAY_CPUS = 3


@pytest.mark.usefixtures("local_ray")
def test_the_three_recoveries_of_one_job_end_in_one_state_and_are_reported(tmp_path):
    path = tmp_path / "scale.json"
    # one failure in the run without the standby (the benchmark's default is two: two samples of the restore);
    # the run with it ends after its failure, not waiting for the restarted process to stand by again
    doc = scale_benchmark(["tiny-opt"], ("fp32",), json_path=str(path), say=lambda line: None, restarts=1,
                          next_standby=False)
    (row,) = doc["rows"]
    assert row["exact"] is True and doc["targets"]["every_run_exact"] is True
    assert row["recovery_standby_replaced_by"] == "standby"
    for run in ("standby", "restart"):  # the image each recovered from, and the records after it that it replayed
        assert 0 < row[f"recovery_{run}_recovered_step"] <= FAIL_AT
        assert row[f"recovery_{run}_image_step"] + row[f"recovery_{run}_replayed_records"] == \
            row[f"recovery_{run}_recovered_step"]
    assert "standby" in row["recovery_standby_phases"] and "restart" in row["recovery_restart_phases"]
    assert row["recovery_standby_seconds"] > 0 and row["recovery_restart_seconds"] > 0 and row["baseline_seconds"] > 0
    assert row["baseline"]["checkpoint_step"] in (4, 8)  # every 4 steps, killed at 9: the write of 8 may be lost
    assert row["state_bytes"] == row["params"] * 4
    # the shadow's own accounting: the replica and one image, and the profile's scratch at most
    assert 2.0 <= row["shadow_accounted_peak_x"] <= 2.0 + (64 << 20) / row["state_bytes"]
    # /proc: each run's trainers over the baseline of a process Ray started, the larger of the two runs'
    assert {"trainer", "trainer_fp32"} <= set(doc["footprints"])
    assert set(row["trainer_peak_x_by_run"]) == {"standby", "restart"}
    assert row["trainer_peak_x"] == max(row["trainer_peak_x_by_run"].values())
    # a model this small fills no chunk buffers: the idle baseline
    assert row["trainer_peak_x_by_run"]["standby"] == \
        (row["trainer_peak_bytes"] - doc["footprints"]["trainer"]) / row["state_bytes"]
    # /proc: over the shadow's own memory before its state arrived
    assert 0 < row["shadow_baseline_bytes"] < row["shadow_peak_bytes"]
    assert row["shadow_peak_x"] == (row["shadow_peak_bytes"] - row["shadow_baseline_bytes"]) / row["state_bytes"]
    assert 0 < row["copy_gbps"] and 0 < row["snapshot_gbps"] and 0 < row["restore_gbps"]
    # each against the plain copy on its own threads, into memory of its kind: an image reused (touched), or a new one
    assert row["snapshot_threads"] == 1  # the shadow's one CPU (shadow_cpus), as the startup profile chose
    by_threads = {"touched": row["copy_gbps_by_threads"], "fresh": row["fresh_copy_gbps_by_threads"]}
    assert row["snapshot_copy_gbps"] == by_threads[row["snapshot_into"]][1]
    assert row["snapshot_fraction"] == row["snapshot_gbps"] / row["snapshot_copy_gbps"]
    all_cores = {"touched": row["copy_gbps"], "fresh": row["fresh_copy_gbps"]}[row["snapshot_into"]]
    assert row["snapshot_fraction_all_cores"] == row["snapshot_gbps"] / all_cores
    assert row["snapshot_with_standby_gbps"] > 0 and row["snapshot_with_standby_fraction"] > 0  # the other run's
    # a restore runs on every core of the trainer (up to 8), into a prefaulted skeleton
    assert row["restore_threads"] == min(8, len(os.sched_getaffinity(0)))
    assert row["restore_copy_gbps"] == row["copy_gbps_by_threads"][row["restore_threads"]]
    assert row["restore_fraction"] == row["restore_gbps"] / row["restore_copy_gbps"]
    # the best of the runs' restores: Ray's restart, and the standby's unless it held the offered image (it copied
    # nothing then)
    samples = row["restore_samples_gbps"]
    assert len(samples) == 1 + (not row["recovery_standby_preinstalled"]) and row["restore_gbps"] == max(samples)
    assert row["restore_measured_in"] == "restart" or not row["recovery_standby_preinstalled"]
    assert row["restore_cold_gbps"] == samples[-1]
    assert json.loads(path.read_text())["rows"][0]["exact"] is True
    (projected,) = [p for p in doc["projections"] if p["job"].startswith("OPT-13B")]
    assert projected["shadow_host_bytes"] > 2 * 12_853_473_280 * 2  # two copies of the fp16 state, and a baseline
    text = markdown(doc)
    assert "| tiny-opt | fp32 |" in text and "OPT-13B" in text
    assert f"{row['restore_threads']}; {row['restore_fraction_all_cores']:.2f})" in text


@pytest.mark.usefixtures("local_ray")
def test_a_size_whose_run_fails_is_reported_and_the_sizes_after_it_still_run(monkeypatch):
    measured = []

    def measure(size, dtype, *args):
        measured.append((size, dtype))
        raise NonFiniteError("step 9: non-finite loss (loss+=nan, loss-=nan); lower eps or lr")

    monkeypatch.setattr(scale_module, "measure", measure)
    monkeypatch.setattr(scale_module, "_footprints", lambda dtypes: {"trainer": 1})
    said = []
    with pytest.raises(RuntimeError, match=r"no size was measured.*'size': '14M', 'dtype': 'bf16', 'error': "
                                           r"'NonFiniteError: step 9: non-finite loss"):
        scale_benchmark(["tiny-opt", "14M"], ("fp32", "bf16"), say=said.append)
    assert measured == [("tiny-opt", "fp32"), ("tiny-opt", "bf16"), ("14M", "fp32"), ("14M", "bf16")]
    assert "  tiny-opt fp32: failed: NonFiniteError: step 9: non-finite loss (loss+=nan, loss-=nan); lower eps or lr" \
        in said


def test_a_failed_size_fails_the_exactness_target():
    row = {"params": 25_408, "state_bytes": 101_632, "shadow_peak_x": 2.0, "trainer_peak_x": 1.0, "copy_gbps": 1.0,
           "snapshot_fraction": 1.0, "restore_fraction": 1.0, "recovery_standby_seconds": 0.1, "speedup_standby": 9.0,
           "exact": True}
    assert targets([row])["every_run_exact"] is True
    failed = [{"size": "1B", "dtype": "bf16", "error": "NonFiniteError: step 9"}]
    assert targets([row], failed)["every_run_exact"] is False


def test_a_restart_count_the_benchmark_cannot_run_is_refused_before_any_work():
    for restarts in (0, 3):
        with pytest.raises(ValueError, match=rf"restarts must be 1 to 2, got {restarts}"):
            scale_benchmark(["tiny-opt"], ("fp32",), restarts=restarts)


@pytest.mark.parametrize("size", list(SIZES))
def test_a_size_is_counted_from_its_shape_and_skipped_where_memory_cannot_hold_it(size):
    hidden, layers, vocab = SIZES[size]
    config = transformers.OPTConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                    ffn_dim=2 * hidden if size == "tiny-opt" else 4 * hidden,
                                    num_attention_heads=4 if size == "tiny-opt" else hidden // 64,
                                    max_position_embeddings=128, word_embed_proj_dim=hidden)
    with torch.device("meta"):
        model = transformers.OPTForCausalLM(config)
    assert parameters_of(size) == sum(p.numel() for p in model.parameters())
    fp32 = parameters_of(size) * 4
    assert too_big(size, "fp32", available=100 * fp32 + (8 << 30)) is None
    reason = too_big(size, "fp32", available=fp32)
    assert reason is not None and "GiB available" in reason
    assert too_big(size, "bf16", available=6 * fp32 // 2 + (4 << 30)) is None
