"""`SFTTask`: TRL's SFT loss on prepared rows (`sft/prepare.py`), held-out loss and perplexity, and greedy generations.

    task = build_task(TaskConfig(kind="sft", data_path="chats.jsonl"), "tiny-chat")
    task.loss(model, task.batch(t))       # mean cross-entropy over the trained tokens, as the model's own loss
    task.evaluate(model)                  # {"loss": ..., "perplexity": ...}, token-weighted over held-out rows
    task.samples(model)                   # [(prompt text, generated text), ...] for the run's log
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zocheck_ray.workload.sft.prepare import SFTExample
from zocheck_ray.workload.sft.rows import CONVERSATIONAL
from zocheck_ray.workload.tasks import IGNORE, LanguageModelingTask, _pad
from zocheck_ray.workload.task_config import TaskConfig
from zocheck_ray.workload.tokenization import HFTokenizer


def end_of_turn_id(tok) -> int | None:
    """The added token that ends an assistant turn in the tokenizer's own template (ChatML's <|im_end|>): the first
    one after the generation prompt in a rendered reply."""
    user = [{"role": "user", "content": "x"}]
    try:
        prompt = tok.apply_chat_template(user, tokenize=True, return_dict=True, add_generation_prompt=True)
        whole = tok.apply_chat_template(user + [{"role": "assistant", "content": "y"}], tokenize=True,
                                        return_dict=True)
    except Exception:  # a template that needs more than this probe: EOS alone stops
        return None
    added = set(tok.get_added_vocab().values())
    prompt_ids, ids = list(prompt["input_ids"]), list(whole["input_ids"])
    start = next((i for i, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b), min(len(prompt_ids), len(ids)))
    return next((t for t in ids[start:] if t in added), None)


class SFTTask(LanguageModelingTask):
    """Kind `sft`: labels are the ids where the loss mask is 1 (TRL's labels), shifted as the model's loss shifts
    them; batches are right-padded as TRL's collator pads them."""

    metric = "loss"
    higher_is_better = False

    def __init__(self, config: TaskConfig, tokenizer: HFTokenizer, train: list[SFTExample],
                 held_out: list[SFTExample], dev: list[SFTExample] = (), *, sft_format: str = "language_modeling",
                 fingerprint: str = "", dropped: int = 0):
        super().__init__(config, tokenizer, train, held_out, dev)
        self.sft_format = sft_format
        self.fingerprint = fingerprint
        """`rows_fingerprint` of the checked rows as read: the training rows, then held-out rows given apart."""
        self.dropped = dropped
        """Rows dropped for having no trained token within `max_length`, as TRL drops them."""
        stop = {tokenizer.eos_id, end_of_turn_id(tokenizer.tokenizer) if sft_format in CONVERSATIONAL else None}
        self.stop_ids = sorted(stop - {None})
        """Ids that end a generation: EOS, and the template's end of turn for conversational rows."""

    def _collate(self, examples: list[SFTExample]) -> dict[str, torch.Tensor]:
        ids, mask = _pad([ex.input_ids for ex in examples], self.tokenizer.pad_id)
        loss_mask = torch.zeros(ids.shape, dtype=torch.long)
        for r, ex in enumerate(examples):
            loss_mask[r, :len(ex.loss_mask)] = torch.tensor(ex.loss_mask, dtype=torch.long)
        targets = torch.full(ids.shape, IGNORE, dtype=torch.long)
        targets[:, :-1] = torch.where(loss_mask[:, 1:] == 1, ids[:, 1:], IGNORE)  # position t predicts t + 1
        return {"input_ids": ids, "attention_mask": mask, "targets": targets}

    def _cross_entropy(self, model, batch, reduction: str) -> torch.Tensor:
        # the model's own loss (transformers' ForCausalLMLoss): one cross-entropy over every position, in float32
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1),
                               ignore_index=IGNORE, reduction=reduction)

    def _nll(self, model, batch):
        return self._cross_entropy(model, batch, "sum"), (batch["targets"] != IGNORE).sum()

    def _loss(self, model, batch):
        if not bool((batch["targets"] != IGNORE).any()):  # as TRL: a batch with no target costs 0, not 0 / 0
            return self._cross_entropy(model, batch, "sum")
        return self._cross_entropy(model, batch, "mean")

    def summary(self) -> dict:
        return super().summary() | {"format": self.sft_format, "dropped_rows": self.dropped,
                                    "fingerprint": self.fingerprint[:16]}

    @torch.no_grad()
    def samples(self, model: torch.nn.Module) -> list[tuple[str, str]]:
        """(prompt text, generated text) of the first `eval_generations` held-out rows that have a prompt, greedy."""
        device = next(model.parameters()).device
        out = []
        for example in self.eval_examples:
            if len(out) >= self.config.eval_generations:
                break
            if example.prompt_ids is None:
                continue
            ids = example.prompt_ids[-(self.config.max_length - 1):]  # room for one new token at least
            generated: list[int] = []
            for _ in range(min(self.config.max_new_tokens, self.config.max_length - len(ids))):
                x = torch.tensor([ids + generated], device=device)
                logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, -1]
                token = int(logits.float().argmax())
                if token in self.stop_ids:
                    break
                generated.append(token)
            out.append((example.prompt_text, self.tokenizer.decode(generated)))
        return out


__all__ = ["SFTTask"]
