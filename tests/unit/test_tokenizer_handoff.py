"""A full snapshot of a byte-level run carries its tokenizer: `AutoTokenizer.from_pretrained(snapshot)` encodes
as the run did, bit for bit, where every byte has an id of its own (vocab_size >= 258); below that it raises one
line naming `ByteTokenizer`, never an empty tokenizer. `recover --to` writes the same files."""

from __future__ import annotations

import pytest

from support import trained
from zocheck_ray.config import JobConfig
from zocheck_ray.runtime.shadow import Shadow
from zocheck_ray.storage import SnapshotStore, snapshot_dir
from zocheck_ray.workload.tokenization import ByteTokenizer, byte_tokenizer_files, load_tokenizer

TEXTS = ["It was great", "h\u00e9llo w\u00f6rld \u2713 \u65e5\u672c <s> <pad> </s>", "  two  spaces\nnew\tline\x00", ""]


def autotokenizer(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


@pytest.mark.parametrize("vocab", [258, 300])
def test_from_258_ids_the_files_encode_and_decode_as_the_byte_tokenizer(tmp_path, vocab):
    for name, text in byte_tokenizer_files(vocab).items():
        (tmp_path / name).write_text(text)
    tok, run = autotokenizer(tmp_path), ByteTokenizer(vocab)
    assert [tok(t)["input_ids"] for t in TEXTS] == run.encode(TEXTS)
    assert tok(TEXTS, padding=True)["input_ids"][3] == [1] + [0] * (len(run.encode(TEXTS)[1]) - 1)  # 0 pads
    assert [tok.decode(ids, skip_special_tokens=True) for ids in run.encode(TEXTS)] == TEXTS


def test_below_258_ids_autotokenizer_raises_naming_the_byte_tokenizer(tmp_path):
    for name, text in byte_tokenizer_files(128).items():
        (tmp_path / name).write_text(text)
    with pytest.raises(Exception, match=r"folds 256 bytes into 126 ids.*ByteTokenizer\(128\)"):
        autotokenizer(tmp_path)


def snapshot_of_a_byte_level_run(tmp_path, vocab: int) -> tuple[JobConfig, str]:
    """A model directory without a tokenizer (so the run is byte-level), trained 4 steps; its snapshot at 4."""
    from zocheck_ray.workload import build_model

    model_dir = tmp_path / "model"
    build_model("tiny-opt", overrides={"vocab_size": vocab}).save_pretrained(model_dir)
    job = JobConfig(model=str(model_dir), storage=str(tmp_path / "runs"), shadow={"snapshot_interval": 4})
    initial, _, records = trained(job, 4)
    shadow = Shadow(job)
    try:
        shadow.initialize(0, initial)
        shadow.push(b"".join(r.to_bytes() for r in records))
        assert shadow.drain(4, timeout=120).durable_step == 4
    finally:
        shadow.close()
    return job, f"{job.run_url}/{snapshot_dir(4)}"


@pytest.mark.parametrize("vocab", [128, 300])
def test_a_byte_level_runs_snapshot_and_recovered_directory_carry_its_tokenizer(tmp_path, vocab):
    from zocheck_ray.cli import main

    job, snapshot = snapshot_of_a_byte_level_run(tmp_path, vocab)
    assert main(["recover", "--storage", job.run_url, "--to", str(tmp_path / "recovered")]) == 0
    for directory in (snapshot, tmp_path / "recovered"):
        if vocab < 258:  # bytes share ids: one line saying what to use, never an empty tokenizer
            with pytest.raises(Exception, match=rf"folds 256 bytes into 126 ids.*ByteTokenizer\({vocab}\)"):
                autotokenizer(directory)
        else:
            assert [autotokenizer(directory)(t)["input_ids"] for t in TEXTS] == ByteTokenizer(vocab).encode(TEXTS)
        assert isinstance(load_tokenizer(directory, vocab), ByteTokenizer)  # a run from it tokenizes as this one
    SnapshotStore(job.run_url, create=False).check(4)  # the tokenizer's files are hashed in the manifest
