"""Your own collator and loss (`workload/custom.py`), without Ray: Trainer's call of `compute_loss_func`, the batch of
step t a pure function of (data_seed, t), and one line naming the function or the row for what cannot run."""

from __future__ import annotations

import pytest
import torch

from zocheck_ray.workload import TaskConfig, build_model
from zocheck_ray.workload.custom import Workload, build_custom_task, rows_fingerprint
from zocheck_ray.workload.errors import WorkloadError

CONFIG = TaskConfig(kind="sft", batch_size=4, eval_size=4)


def rows(n: int, ragged: bool = True) -> list[dict]:
    return [{"input_ids": [1, *range(2, 6 + (i % 3 if ragged else 0))], "labels": [-100, *range(2, 6 + (
        i % 3 if ragged else 0))]} for i in range(n)]


def summed(outputs, labels, num_items_in_batch=None):
    logits = outputs.logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             ignore_index=-100, reduction="sum") / num_items_in_batch


def test_the_loss_is_trainers_call_and_equals_the_models_own_mean():
    model = build_model("tiny-llama")
    mine = build_custom_task(CONFIG, rows(20, ragged=False), compute_loss_func=summed)
    theirs = build_custom_task(CONFIG, rows(20, ragged=False))  # no loss function: the model's own
    batch = mine.batch(3)
    assert torch.equal(batch["input_ids"], theirs.batch(3)["input_ids"])
    assert torch.equal(batch["input_ids"], mine.batch(3)["input_ids"])  # a pure function of (data_seed, t)
    assert float(mine.loss(model, batch)) == pytest.approx(float(theirs.loss(model, batch)), rel=1e-6)


def test_ragged_rows_without_a_padding_collator_are_refused_before_any_actor():
    with pytest.raises(WorkloadError, match="^data_collator default_data_collator raised ValueError: .* rows of "
                                            "different lengths need a padding collator"):
        build_custom_task(CONFIG, rows(20))


@pytest.mark.parametrize("loss, said", [
    (lambda outputs, labels, num_items_in_batch=None: outputs.logits.mean(-1), "returned a loss of shape [4, "),
    (lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum() * float("nan"), "a non-finite loss"),
    (lambda outputs, labels, num_items_in_batch=None: 1 / 0, "raised ZeroDivisionError: division by zero"),
])
def test_a_loss_function_that_cannot_drive_a_step_is_named(loss, said):
    task = build_custom_task(CONFIG, rows(20, ragged=False), compute_loss_func=loss)
    with pytest.raises(WorkloadError, match="^compute_loss_func test_custom_task.<lambda> ") as refused:
        task.loss(build_model("tiny-llama"), task.batch(0))
    assert said in str(refused.value)


def test_what_is_not_a_function_or_not_rows_is_refused_naming_it():
    with pytest.raises(WorkloadError, match="^data_collator must be a function, got int"):
        build_custom_task(CONFIG, rows(8), data_collator=3)
    with pytest.raises(WorkloadError, match=r"^train_dataset row 1: Object of type object is not JSON serializable"):
        rows_fingerprint([{"a": 1}, {"a": object()}], "train_dataset")
    with pytest.raises(WorkloadError, match="holds out every row of the train_dataset"):
        build_custom_task(CONFIG, rows(4, ragged=False))


def test_sft_rows_with_a_model_init_and_no_tokenizer_ask_for_processing_class():
    from zocheck_ray.workload.model_init import ModelInit, register

    init = ModelInit.probe(lambda: build_model("tiny-llama"), seed=0)
    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 8
    with pytest.raises(WorkloadError, match="brings no tokenizer: give processing_class"):
        Workload(train_rows=chats, model_init=init).build(CONFIG, register(init))
