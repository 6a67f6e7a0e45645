"""Text to token ids: a byte-level tokenizer for models built from config, or the model's own.

    tok = load_tokenizer("tiny-opt", vocab_size=128)
    tok.encode(["It was great"])[0]       # [1, 75, 118, 34, ...]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Literal, Protocol, Sequence

from zocheck_ray.workload.data import encode as byte_encode
from zocheck_ray.workload.errors import ModelNotFoundError, WorkloadError
from zocheck_ray.workload.names import CHAT_TOKENIZER_MODELS, MODEL_INIT_PREFIX

TokenizerChoice = Literal["auto", "byte", "model"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json")
"""Any of these in a model directory means it carries its own tokenizer."""


class MissingTokenizerError(ModelNotFoundError):
    """A model directory has no tokenizer files and the job did not ask for byte-level ids."""


class TextTokenizer(Protocol):
    """What a task needs from a tokenizer."""

    pad_id: int
    """Id used for padding (masked out of attention and loss)."""
    vocab_size: int
    """Ids are below this; it must not exceed the model's embedding rows."""
    adds_bos: bool
    """Whether `encode` puts a BOS first."""
    eos_id: int | None
    """The EOS id, if any."""

    def encode(self, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]:
        """Ids with the sequence-start specials the model expects; right-truncated to `max_length`."""
        ...

    def describe(self) -> str:
        """A short human-readable name, for logs and error messages."""
        ...


class ByteTokenizer:
    """UTF-8 bytes folded into `vocab_size` ids (`data.encode`): 0 pads, 1 starts a sequence."""

    pad_id = 0
    adds_bos = True
    eos_id = None

    def __init__(self, vocab_size: int):
        if vocab_size < 3:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 3, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]:
        return [byte_encode(t, self.vocab_size)[:max_length] for t in texts]

    def describe(self) -> str:
        return f"byte-level (vocab {self.vocab_size})"

    def decode(self, ids: Sequence[int]) -> str:
        """The text of generated ids (exact when vocab_size >= 258)."""
        return bytes((i - 2) % 256 for i in ids if i >= 2).decode("utf-8", errors="replace")


EXACT_BYTE_VOCAB = 258
"""From this vocab_size each byte has an id of its own."""


def byte_tokenizer_files(vocab_size: int) -> dict[str, str]:
    """A full snapshot's files with which `AutoTokenizer` encodes as `ByteTokenizer(vocab_size)`. Below
    `EXACT_BYTE_VOCAB` bytes share ids (no exact decoder): its tokenizer.json makes it raise, naming `ByteTokenizer`."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "pad_token": "<pad>",
              "split_special_tokens": True,  # "<s>" in a text is its bytes, as for ByteTokenizer
              "model_max_length": 1_000_000_000, "clean_up_tokenization_spaces": False}
    version = "1.0" if vocab_size >= EXACT_BYTE_VOCAB else (  # tokenizers raises, naming it
        f"none: this run's byte-level tokenizer folds 256 bytes into {vocab_size - 2} ids, which no Hugging Face "
        f"tokenizer decodes; use zocheck_ray.workload.tokenization.ByteTokenizer({vocab_size})")
    tokenizer = _byte_level_json(vocab_size, version, ())
    return {"tokenizer.json": json.dumps(tokenizer, ensure_ascii=False),
            "tokenizer_config.json": json.dumps(config)}


def _byte_level_json(vocab_size: int, version: str, specials: Sequence[str]) -> dict:
    """tokenizers' JSON of one token per byte at 2 + byte (folded below `EXACT_BYTE_VOCAB`), <pad> 0, <s> 1 put
    first, and `specials` from 258 on."""
    chars = _byte_chars()
    vocab = {"<pad>": 0, "<s>": 1, **{chars[b]: 2 + b % (vocab_size - 2) for b in range(256)}}
    vocab.update({token: EXACT_BYTE_VOCAB + i for i, token in enumerate(specials)})
    special = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    added = [{"id": vocab[token], "content": token, **special} for token in ("<pad>", "<s>", *specials)]
    bos, a, b = ({"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}})
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": version, "truncation": None, "padding": None,
        "added_tokens": added,
        "normalizer": None, "pre_tokenizer": byte_level,
        "post_processor": {"type": "TemplateProcessing", "single": [bos, a], "pair": [bos, a, b],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},  # no merges: one token per byte
    }


CHAT_SPECIALS = ("</s>", "<|im_start|>", "<|im_end|>")
"""`tiny-chat`'s tokens beyond the bytes: EOS, then ChatML's turn delimiters, at 258, 259, 260."""
CHAT_VOCAB = EXACT_BYTE_VOCAB + len(CHAT_SPECIALS)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML after a BOS; the assistant's content and its <|im_end|> inside `{% generation %}`, so
`return_assistant_tokens_mask=True` marks what TRL's `assistant_only_loss` trains on."""


def chat_tokenizer_files() -> dict[str, str]:
    """`tiny-chat`'s tokenizer as a snapshot holds it: one id per byte as `byte_tokenizer_files(258)`, with
    EOS, ChatML's specials and `CHAT_TEMPLATE` (specials in a text are the tokens, as in any HF tokenizer)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "pad_token": "<pad>",
              "model_max_length": 1_000_000_000, "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": json.dumps(_byte_level_json(CHAT_VOCAB, "1.0", CHAT_SPECIALS), ensure_ascii=False),
            "tokenizer_config.json": json.dumps(config), "chat_template.jinja": CHAT_TEMPLATE}


def chat_tokenizer():
    """`tiny-chat`'s `PreTrainedTokenizerFast`, loaded from `chat_tokenizer_files()` as from a snapshot."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="zocheck-tiny-chat-") as directory:
        for name, text in chat_tokenizer_files().items():
            (Path(directory) / name).write_text(text, encoding="utf-8")
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def _byte_chars() -> dict[int, str]:
    # GPT-2's printable stand-in for each byte, which the ByteLevel pre-tokenizer and decoder use
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


OPT_BOS_ID = 0
"""MeZO's run.py sets OPT's `bos_token_id = 0`."""


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (no network), or `tokenizer` as given; `bos_id`
    replaces its BOS."""

    def __init__(self, directory: str | Path | None, bos_id: int | None = None, tokenizer=None,
                 name: str | None = None):
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(Path(directory), local_files_only=True)
        self.directory = None if directory is None else Path(directory)
        self.name = name if name is not None else f"from {self.directory}"
        self.tokenizer = tok = tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.vocab_size = len(tok)
        self.eos_id = tok.eos_token_id
        first = tok("a", add_special_tokens=True)["input_ids"][:1]
        self.adds_bos = tok.bos_token_id is not None and first == [tok.bos_token_id]
        self.bos_id = bos_id if self.adds_bos else None

    def encode(self, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]:
        if not texts:
            return []
        # The tokenizer's own truncation keeps trailing specials such as BERT's [SEP].
        out = self.tokenizer(list(texts), add_special_tokens=True, truncation=max_length is not None,
                             max_length=max_length)
        if self.bos_id is None:
            return [list(ids) for ids in out["input_ids"]]
        return [[self.bos_id, *ids[1:]] for ids in out["input_ids"]]

    def describe(self) -> str:
        return f"{type(self.tokenizer).__name__} {self.name}"

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def hf_tokenizer(tokenizer: TextTokenizer | object) -> HFTokenizer:
    """Kind sft's tokenizer: an `HFTokenizer` (a `PreTrainedTokenizerBase` is wrapped); a byte-level one is refused."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer
    if hasattr(tokenizer, "apply_chat_template"):
        return HFTokenizer(None, tokenizer=tokenizer, name="given to build_task")
    raise WorkloadError(
        f"task kind 'sft' tokenizes as TRL does, with the model's own Hugging Face tokenizer, but this run's is "
        f"{tokenizer.describe()}, whose ids a pretrained model does not know and which has no EOS or chat template; "
        "use a model directory saved with its tokenizer, or model tiny-chat, and task.tokenizer 'auto' or 'model'")


def has_tokenizer(directory: str | Path | None) -> bool:
    return directory is not None and any((Path(directory) / f).is_file() for f in TOKENIZER_FILES)


MODEL_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                         "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json")
"""A model directory's tokenizer files a full snapshot copies (text: a sentencepiece model alone is not copied)."""


def snapshot_tokenizer_files(model_dir: str | Path | None, vocab_size: int, choice: TokenizerChoice = "auto",
                             model: str | None = None) -> dict[str, str]:
    """What a full snapshot holds so that `AutoTokenizer.from_pretrained(snapshot)` gives the run's tokenizer;
    `model`: the run's model name (`tiny-chat` has a tokenizer without a directory; a `model_init`'s tokenizer is
    the user's, saved beside the model by `ZOTrainer.save_model`)."""
    if model is not None and model.startswith(MODEL_INIT_PREFIX):
        return {}
    if is_byte_level(model_dir, vocab_size, choice, model):
        return byte_tokenizer_files(vocab_size)
    if model_dir is None and model in CHAT_TOKENIZER_MODELS:
        return chat_tokenizer_files()
    found = {name: Path(model_dir) / name for name in MODEL_TOKENIZER_FILES if (Path(model_dir) / name).is_file()}
    if not found.keys() & {"tokenizer.json", "vocab.json", "vocab.txt"}:
        return {}  # a sentencepiece model alone: nothing here loads without it
    return {name: path.read_text(encoding="utf-8") for name, path in found.items()}


def is_byte_level(model_dir: str | Path | None, vocab_size: int, choice: TokenizerChoice = "auto",
                  model: str | None = None) -> bool:
    """Whether `load_tokenizer` gives a `ByteTokenizer` (a byte-level run's snapshot too)."""
    if model_dir is None and model in CHAT_TOKENIZER_MODELS:
        return choice == "byte"
    return choice == "byte" or (choice == "auto" and not has_tokenizer(model_dir)) or \
        _is_byte_snapshot(model_dir, vocab_size)


def load_tokenizer(model_dir: str | Path | None, vocab_size: int, choice: TokenizerChoice = "auto",
                   model: str | None = None) -> TextTokenizer:
    """The tokenizer for a model: `auto` the directory's own (`tiny-chat`: `chat_tokenizer()`; a built-in model built
    from config, or a byte-level run's snapshot: byte-level); `model` requires the directory's; `byte` byte-level.
    `model` is the model's name, `model_dir` its directory (None: built-in). A model directory without a tokenizer
    is refused under `auto`: its ids would not be the ones it was pretrained on."""
    if choice == "auto" and model_dir is not None and not has_tokenizer(model_dir):
        raise MissingTokenizerError(
            f"model directory {model_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}), and a pretrained "
            "model's text must be tokenized as it was pretrained: save its tokenizer beside it "
            f"(tokenizer.save_pretrained('{model_dir}')), or set task.tokenizer: byte to train it on byte-level ids")
    if is_byte_level(model_dir, vocab_size, choice, model):
        return ByteTokenizer(vocab_size)
    if model_dir is None and model in CHAT_TOKENIZER_MODELS:
        return HFTokenizer(None, tokenizer=chat_tokenizer(), name=f"of {model}")
    if not has_tokenizer(model_dir):
        where = "a model built from a named config" if model_dir is None else f"model directory {model_dir}"
        raise ModelNotFoundError(f"task.tokenizer is 'model' but {where} has no tokenizer files "
                                 f"({', '.join(TOKENIZER_FILES)}); save one with tokenizer.save_pretrained "
                                 "or set task.tokenizer to 'byte'")
    return HFTokenizer(model_dir, OPT_BOS_ID if _model_type(model_dir) == "opt" else None)


def _is_byte_snapshot(model_dir: str | Path | None, vocab_size: int) -> bool:
    if model_dir is None or not (path := Path(model_dir) / "tokenizer.json").is_file():
        return False
    expected = byte_tokenizer_files(vocab_size)["tokenizer.json"].encode()
    return path.stat().st_size == len(expected) and path.read_bytes() == expected


def _model_type(model_dir: str | Path) -> str | None:
    import json

    config = Path(model_dir) / "config.json"
    return json.loads(config.read_text()).get("model_type") if config.is_file() else None
