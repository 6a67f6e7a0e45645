"""A full snapshot carries its run's tokenizer. A byte-level run's: `AutoTokenizer.from_pretrained(snapshot)`
encodes as the run did, bit for bit, where every byte has an id of its own (vocab_size >= 258); below that it
raises one line naming `ByteTokenizer`, never an empty tokenizer; `recover --to` writes the same files. A run on
its model directory's tokenizer: a copy of its files."""

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


def snapshot_of_a_run(tmp_path, vocab: int, tokenizer=None) -> tuple[JobConfig, str]:
    """A model directory (with `tokenizer` saved beside it; without one the job says `task.tokenizer: byte`), trained
    4 steps; its snapshot at 4."""
    from zocheck_ray.workload import build_model

    model_dir = tmp_path / "model"
    build_model("tiny-opt", overrides={"vocab_size": vocab}).save_pretrained(model_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(model_dir)
    job = JobConfig(model=str(model_dir), storage=str(tmp_path / "runs"), shadow={"snapshot_interval": 4},
                    task={"tokenizer": "auto" if tokenizer is not None else "byte"})
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

    job, snapshot = snapshot_of_a_run(tmp_path, vocab)
    assert main(["recover", "--storage", job.run_url, "--to", str(tmp_path / "recovered")]) == 0
    for directory in (snapshot, tmp_path / "recovered"):
        if vocab < 258:  # bytes share ids: one line saying what to use, never an empty tokenizer
            with pytest.raises(Exception, match=rf"folds 256 bytes into 126 ids.*ByteTokenizer\({vocab}\)"):
                autotokenizer(directory)
        else:
            assert [autotokenizer(directory)(t)["input_ids"] for t in TEXTS] == ByteTokenizer(vocab).encode(TEXTS)
        assert isinstance(load_tokenizer(directory, vocab), ByteTokenizer)  # a run from it tokenizes as this one
    SnapshotStore(job.run_url, create=False).check(4)  # the tokenizer's files are hashed in the manifest


def test_a_run_on_its_model_directorys_tokenizer_snapshots_a_copy_of_it(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "<pad>", "</s>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="</s>", eos_token="</s>", pad_token="<pad>")
    job, snapshot = snapshot_of_a_run(tmp_path, len(tokenizer), tokenizer)
    model_dir = tmp_path / "model"
    assert [autotokenizer(snapshot)(t)["input_ids"] for t in TEXTS] == \
        [autotokenizer(model_dir)(t)["input_ids"] for t in TEXTS]
    run, again = load_tokenizer(model_dir, len(tokenizer)), load_tokenizer(snapshot, len(tokenizer))
    assert again.encode(TEXTS) == run.encode(TEXTS) and again.bos_id == run.bos_id == 0  # OPT: MeZO's BOS
