"""MeZO's tasks give the strings, token ids, scored tokens, losses and metrics MeZO's own code gives.

A byte-level BPE is trained here on the rows and saved with a tiny OPT beside it, so the task is built as a user's
would be, with OPT's specials ("<s>" 0, "<pad>" 1, "</s>" 2; the tokenizer starts a sequence with "</s>"). The
expected values are worked out as MeZO's large_models/ code works them out (docs/fidelity.md cites each line):
templates.py's strings, utils.py `encode_prompt` (texts stripped of spaces, option_len the difference of the token
counts, BOS plus the last max_length - 1 tokens), run.py's OPT bos_token_id = 0, `forward` (mean log-probability of
the last option_len tokens), `forward_wrap_with_option_len` (COPA's loss on the gold option's tokens), generation
(greedy, 50 new tokens, stop at the id of "\\n" or EOS) and metrics.py's F1.
"""

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from zocheck_ray.workload import TaskConfig, build_model, build_task
from zocheck_ray.workload.examples import MAX_NEW_TOKENS
from zocheck_ray.workload.tasks import IGNORE, f1_score

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROWS = {
    "sst2": [{"sentence": "a gripping , funny film ", "label": 1}, {"sentence": "dull and long ", "label": 0}],
    "copa": [{"premise": "The sun rose.", "choice1": "The grass was wet.", "choice2": "The birds sang.",
              "question": "effect", "label": 1},
             {"premise": "I was cold.", "choice1": "I shivered.", "choice2": "The sun rose.", "question": "effect",
              "label": 0}],
    "rte": [{"premise": "It rains " * 40 + "today.", "hypothesis": "It is wet.", "label": 0},
            {"premise": "The sun rose.", "hypothesis": "It is night.", "label": 1}],
    "squad": [{"title": "Sky", "context": "The sky is blue.\n\nGrass is green.", "question": "What is blue?",
               "answers": {"text": ["the sky", "sky"], "answer_start": [0, 4]}},
              {"title": "Sun", "context": "The sun is hot.", "question": "What is hot?",
               "answers": {"text": ["The sun"], "answer_start": [0]}}],
}
MAX_LENGTH = 64

PAIRS = [{"premise": "The cat sat.", "hypothesis": "A cat sits.", "label": 0},
         {"premise": "Rain fell.", "hypothesis": "It is dry.", "label": 1}]
ROWS |= {
    "cb": PAIRS,
    "boolq": [{"passage": "Cats purr.", "question": "do cats purr", "label": True},
              {"passage": "Dogs bark.", "question": "do dogs meow?", "label": False}],
    "wsc": [{"text": "Mark told Pete he won.", "span1_text": "Mark", "span2_text": "He", "label": 1},
            {"text": "Ann met Sue as she left.", "span1_text": "Ann", "span2_text": "she", "label": 0}],
    "wic": [{"word": "bank", "sentence1": "A river bank.", "sentence2": "A bank loan.", "label": 0},
            {"word": "run", "sentence1": "I run.", "sentence2": "We run.", "label": 1}],
    "multirc": [{"paragraph": "Ann has two cats.", "question": "What does Ann have?", "answer": "cats", "label": 1},
                {"paragraph": "Bob has a dog.", "question": "What does Bob have?", "answer": "a cat", "label": 0}],
}
TEMPLATE_TEXTS = {  # templates.py's prompt of row 0 and its candidates, in class order
    "rte": (ROWS["rte"][0]["premise"] + '\nDoes this mean that "It is wet." is true? Yes or No?\n', ("Yes", "No")),
    "cb": ('Suppose The cat sat. Can we infer that "A cat sits."? Yes, No, or Maybe?\n', ("Yes", "No", "Maybe")),
    "boolq": ("Cats purr. Do cats purr?\n", ("Yes", "No")),
    "wsc": ('Mark told Pete he won.\nIn the previous sentence, does the pronoun "he" refer to Mark? Yes or No?\n',
            ("No", "Yes")),
    "wic": ('Does the word "bank" have the same meaning in these two sentences? Yes, No?\nA river bank.\n'
            "A bank loan.\n", ("No", "Yes")),
    "multirc": ('Ann has two cats.\nQuestion: What does Ann have?\nI found this answer "cats". Is that correct? '
                "Yes or No?\n", ("No", "Yes")),
}


@pytest.fixture(scope="module")
def opt_dir(tmp_path_factory):
    """A tiny OPT with a byte-level BPE trained on the rows, saved as a model directory."""
    corpus = [json.dumps(r) for rows in ROWS.values() for r in rows] * 4 + ["It was great\n\n", "Answer: sky\n"] * 8
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "<pad>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="</s>", eos_token="</s>", pad_token="<pad>")
    path = tmp_path_factory.mktemp("opt-bpe")
    model = build_model("tiny-opt", seed=5, overrides={"vocab_size": len(tokenizer), "pad_token_id": 1,
                                                        "bos_token_id": 2, "eos_token_id": 2})
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, tokenizer, model


def task_of(tmp_path, opt_dir, kind, **fields):
    path = tmp_path / f"{kind}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[kind]))
    config = dict(kind=kind, data_path=str(path), eval_path=str(path), max_length=MAX_LENGTH, batch_size=1,
                  eval_size=2, eval_batch_size=2)
    config.update(fields)
    return build_task(TaskConfig(**config), str(opt_dir[0]))


def mezo_ids(tokenizer, text: str) -> list[int]:
    """MeZO's tokenizer.encode with run.py's OPT fix: the first id is bos_token_id = 0."""
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == 2
    return [0, *ids[1:]]


def mezo_encode(tokenizer, prompt: str, verbalized: str, max_length: int) -> tuple[list[int], int]:
    """utils.py encode_prompt for one candidate, no demonstrations."""
    prompt, verbalized = prompt.strip(" "), verbalized.strip(" ")
    ids = mezo_ids(tokenizer, verbalized)
    option_len = len(ids) - len(mezo_ids(tokenizer, prompt))
    return ids[0:1] + ids[1:][-(max_length - 1):], option_len


def mezo_option_log_probs(model, ids: list[int], option_len: int, logits=None) -> torch.Tensor:
    """run.py Framework.forward: log p of each token, the last option_len of them (`logits`: a forward's own)."""
    if logits is None:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
    labels = torch.tensor(ids[1:])
    return torch.log_softmax(logits[:len(ids) - 1], dim=-1)[torch.arange(len(labels)), labels][-option_len:]


def test_sst2_strips_the_sentence_and_scores_every_token_after_it_was(tmp_path, opt_dir):
    _, tokenizer, model = opt_dir
    task = task_of(tmp_path, opt_dir, "sst2", text_field="sentence")
    example = task.eval_examples[0]
    for word, sequence, option_len in zip(("terrible", "great"), example.sequences, example.option_lens):
        text = f"a gripping , funny film It was {word}"  # templates.py SST2Template: one space before "It"
        assert tokenizer.decode(sequence[1:]) == text
        assert (sequence, option_len) == mezo_encode(tokenizer, "a gripping , funny film It was", text, MAX_LENGTH)
        assert tokenizer.decode(sequence[-option_len:]) == f" {word}"
    batch = task._eval_collate([example])
    scores = task.scores(model, batch)
    with torch.no_grad():  # the batch's own forward (its rows padded), so that only the scoring rule is compared
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    for k, (sequence, option_len) in enumerate(zip(example.sequences, example.option_lens)):
        row = batch["input_ids"][k][:len(sequence)]
        assert row.tolist() == sequence
        picked = batch["targets"][k] != IGNORE
        assert batch["targets"][k][picked].tolist() == sequence[-option_len:]
        # utils.py forward_wrap_with_option_len (train_as_classification): masked sum over the row / option_len
        shift = batch["input_ids"][k, 1:].clone()
        mask = torch.zeros_like(shift, dtype=torch.bool)
        mask[len(sequence) - 1 - option_len:len(sequence) - 1] = True
        selected = torch.log_softmax(logits[k, :-1], -1).gather(-1, shift.unsqueeze(-1)).squeeze(-1)
        assert torch.equal(scores[0, k], (selected * mask).sum(-1) / mask.sum(-1))
    # run.py one_step_pred: the argmax of each candidate's mean, one unpadded forward each
    means = [mezo_option_log_probs(model, q, n).mean() for q, n in zip(example.sequences, example.option_lens)]
    assert int(torch.stack(means).argmax()) == int(scores[0].argmax())


def test_copa_scores_every_token_after_the_prompt_and_trains_on_the_gold_option(tmp_path, opt_dir):
    _, tokenizer, model = opt_dir
    task = task_of(tmp_path, opt_dir, "copa")
    example = task.eval_examples[0]
    prompt = "The sun rose so"  # templates.py CopaTemplate, stripped by encode_prompt
    for choice, sequence, option_len in zip(("the grass was wet.", "the birds sang."), example.sequences,
                                            example.option_lens):
        assert tokenizer.decode(sequence[1:]) == f"{prompt} {choice}"
        assert (sequence, option_len) == mezo_encode(tokenizer, prompt, f"{prompt} {choice}", MAX_LENGTH)
        assert tokenizer.decode(sequence[-option_len:]) == f" {choice}"  # " the" scored in both candidates
    # forward_wrap_with_option_len: the gold candidate's tokens' mean cross-entropy, nothing else
    batch = task.batch(0)  # one row: its gold candidate's sequence only
    assert set(batch) == {"input_ids", "attention_mask", "targets"}
    ex = next(ex for ex in task.train_examples if ex.sequences[ex.label] == batch["input_ids"][0].tolist())
    picked = batch["targets"][0] != IGNORE
    assert batch["targets"][0][picked].tolist() == ex.sequences[ex.label][-ex.option_lens[ex.label]:]
    with torch.no_grad():  # utils.py: CrossEntropyLoss(ignore_index=-100) on shift_logits, shift_labels
        shift_logits = model(input_ids=batch["input_ids"]).logits[..., :-1, :].contiguous()
    shift_labels = batch["input_ids"].clone()[..., 1:].contiguous()
    shift_labels[0, :-ex.option_lens[ex.label]] = -100
    want = torch.nn.CrossEntropyLoss(ignore_index=-100)(shift_logits.view(-1, shift_logits.shape[-1]),
                                                        shift_labels.view(-1))
    assert torch.equal(task.loss(model, batch), want)


def test_truncation_keeps_the_bos_and_the_last_max_length_minus_one_tokens(tmp_path, opt_dir):
    _, tokenizer, _ = opt_dir
    task = task_of(tmp_path, opt_dir, "rte")
    example = task.eval_examples[0]
    prompt = ROWS["rte"][0]["premise"] + '\nDoes this mean that "It is wet." is true? Yes or No?\n'
    batch = task._eval_collate([example])
    for k, answer in enumerate(("Yes", "No")):
        full = mezo_ids(tokenizer, prompt + answer)
        assert len(full) > MAX_LENGTH
        want, option_len = mezo_encode(tokenizer, prompt, prompt + answer, MAX_LENGTH)
        assert batch["input_ids"][k][:len(want)].tolist() == want == [0, *full[-(MAX_LENGTH - 1):]]
        assert example.option_lens[k] == option_len


@pytest.mark.parametrize("kind", sorted(TEMPLATE_TEXTS))
def test_every_classification_task_gives_mezo_s_strings_ids_and_scored_tokens(tmp_path, opt_dir, kind):
    _, tokenizer, _ = opt_dir
    task = task_of(tmp_path, opt_dir, kind)
    example = task.eval_examples[0]
    prompt, candidates = TEMPLATE_TEXTS[kind]
    assert len(example.sequences) == len(candidates)
    batch = task._eval_collate([example])
    for k, (candidate, sequence, option_len) in enumerate(zip(candidates, example.sequences, example.option_lens)):
        assert tokenizer.decode(sequence[1:]) == prompt + candidate
        assert tokenizer.decode(sequence[-option_len:]) == candidate
        want, want_len = mezo_encode(tokenizer, prompt, prompt + candidate, MAX_LENGTH)  # truncated as MeZO does
        assert option_len == want_len and batch["input_ids"][k][:len(want)].tolist() == want
        picked = batch["targets"][k] != IGNORE
        assert batch["targets"][k][picked].tolist() == want[-option_len:]


class Scripted(torch.nn.Module):
    """A model whose greedy choice at sequence length n is `script[n - start]` (then `last`)."""

    def __init__(self, script, start, vocab, last):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.script, self.start, self.vocab, self.last = script, start, vocab, last
        self.calls = 0

    def forward(self, input_ids, attention_mask=None):
        self.calls += 1
        n = input_ids.shape[1] - self.start
        token = self.script[n] if n < len(self.script) else self.last
        logits = torch.zeros(1, input_ids.shape[1], self.vocab)
        logits[0, -1, token] = 1.0
        return type("Out", (), {"logits": logits})()


def test_squad_trains_on_answer_and_newline_within_max_length_less_50(tmp_path, opt_dir):
    _, tokenizer, _ = opt_dir
    task = task_of(tmp_path, opt_dir, "squad")
    row = ROWS["squad"][0]
    prompt = f"Title: Sky\nContext: {row['context']}\nQuestion: What is blue?\nAnswer:"  # SQuADv2Template
    example = next(ex for ex in task.eval_examples if ex.answers == ("the sky", "sky"))
    want, option_len = mezo_encode(tokenizer, prompt, f"{prompt} the sky\n", MAX_LENGTH - MAX_NEW_TOKENS)
    assert example.answer_len == option_len and tokenizer.decode(want[-option_len:]) == " the sky\n"
    batch = task._collate([example])
    assert batch["input_ids"][0].tolist() == want and want[0] == 0 and len(want) == MAX_LENGTH - MAX_NEW_TOKENS


def test_squad_decodes_greedily_to_the_newline_id_or_eos_and_scores_mezo_s_f1(tmp_path, opt_dir):
    _, tokenizer, _ = opt_dir
    task = task_of(tmp_path, opt_dir, "squad")
    example = task.eval_examples[0]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"][-1]
    double = tokenizer.convert_tokens_to_ids("ĊĊ")
    assert double not in (None, tokenizer.unk_token_id) and double != newline
    sky = tokenizer(" sky", add_special_tokens=False)["input_ids"]
    start = MAX_LENGTH - MAX_NEW_TOKENS
    # "\n\n" is its own token: MeZO goes on past it (stops at the id of "\n" only), and strips the text
    model = Scripted([*sky, double, *sky, newline], start, len(tokenizer), last=sky[0])
    assert task.answer(model, example) == tokenizer.decode([*sky, double, *sky]).strip() == "sky\n\n sky"
    eos = Scripted([*sky, 2], start, len(tokenizer), last=sky[0])
    assert task.answer(eos, example) == "sky"
    endless = Scripted([], start, len(tokenizer), last=sky[0])
    task.answer(endless, example)
    assert endless.calls == MAX_NEW_TOKENS  # min(max_new_tokens, max_length - prompt length) = 50
    assert f1_score("the", "a") == 0.0  # both normalise to empty: metrics.py gives 0
    assert f1_score("the sky", "sky") == 1.0
