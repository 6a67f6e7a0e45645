"""ZO-Bench's optimizers (ZO-SGD-Sign, -MMT, -Cons) and n-SPSA (q perturbations per step) are exact.

For each new optimizer, and for ZO-SGD, ZO-Adam and Sparse-MeZO, a real Hugging Face model is trained
with `ZOOptimizer` taking several perturbations a step; the eager oracle (`replay_reference`) and the
fused CPU kernel (`replay`, one batch and one step at a time) reproduce every tensor from the records
alone. ZO-SGD-Cons' records
carry the candidate the trainer kept, so replay needs no forward pass: each of its three decisions
is forced by a scripted loss and replayed. The Triton kernels are checked against the same oracle in
test_triton_kernels.py.
"""

import itertools

import pytest
import torch

from zocheck_ray import StepRecord, ZOConfig, ZOOptimizer, replay, replay_reference, state_hash
from zocheck_ray.core.errors import StateMismatchError
from zocheck_ray.core.layout import MOMENTUM_PREFIX, Layout
from zocheck_ray.core.record import CONS_ASCENT, CONS_DESCENT, CONS_START
from zocheck_ray.core.seeds import perturbation_seeds
from zocheck_ray.workload.models import build_model, trainable_parameters

NEW = ["zo-sgd-sign", "zo-sgd-mmt", "zo-sgd-cons"]
STEPS = 6

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: see conftest


def clone(state):
    return {k: v.detach().clone() for k, v in state.items()}


def assert_same_state(actual, expected):
    assert list(actual) == list(expected)
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{name} differs"
    assert state_hash(actual) == state_hash(expected)


def train(optimizer, dtype, q=1, steps=STEPS, lr=1e-3):
    config = ZOConfig(optimizer=optimizer, lr=lr, eps=1e-3 if dtype == "fp32" else 1e-2, weight_decay=0.05,
                      sparsity=0.5, num_perturbations=q)
    model = build_model("tiny-opt", dtype)
    opt = ZOOptimizer(trainable_parameters(model), config)
    initial = clone(opt.state_tensors())
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 128, (2, 12), generator=gen) for _ in range(steps)]
    records = [opt.step(lambda: model(input_ids=batches[t], labels=batches[t]).loss, seed=500 + t)
               for t in range(steps)]
    return config, initial, opt, records


@pytest.mark.slow  # HF models, the new kernels' first compile
# q = 1 of every optimizer x {full, LoRA, prefix} x dtype replays (through failures) in test_recovery_matrix.py
# and test_peft.py; here the full model with three perturbations a step, against the eager oracle too.
@pytest.mark.parametrize("optimizer,dtype,q", [*itertools.product(NEW, ["fp32", "bf16"], [3]),
                                               ("zo-sgd", "bf16", 3), ("zo-adam", "fp32", 2),
                                               ("sparse-mezo", "bf16", 2)])
def test_trainer_and_both_replays_agree(optimizer, dtype, q):
    config, initial, opt, records = train(optimizer, dtype, q)
    assert all(len(r.grads) == q for r in records)
    trained = clone(opt.state_tensors())
    assert state_hash(trained) != state_hash(initial)
    assert_same_state(replay_reference(clone(initial), records, config, start_step=0), trained)
    assert_same_state(replay(clone(initial), records, config, start_step=0), trained)
    one_by_one = clone(initial)
    for r in records:
        replay(one_by_one, [r], config, start_step=r.step)
    assert_same_state(one_by_one, trained)


def test_momentum_is_part_of_the_state():
    config, initial, opt, records = train("zo-sgd-mmt", "fp32")
    state = opt.state_tensors()
    momentum = [k for k in state if k.startswith(MOMENTUM_PREFIX)]
    assert len(momentum) == len(opt.layout.params) and all(state[k].dtype == torch.float32 for k in momentum)
    assert any(state[k].abs().sum() > 0 for k in momentum)
    assert Layout.from_state(state, config) == opt.layout


class Scripted:
    """A closure whose losses are scripted: the start, then loss+ and loss-, then after the descent and
    the ascent moves (ZO-SGD-Cons' five evaluations per step)."""

    def __init__(self, losses):
        self.losses = list(losses)

    def __call__(self):
        return self.losses.pop(0)


@pytest.mark.parametrize("descent,ascent,decision", [
    (2.0, 3.0, CONS_START),     # both moves are worse than the start: back to it
    (2.0, 0.5, CONS_ASCENT),    # the descent is worse, the ascent better than the start
    (0.5, 0.7, CONS_DESCENT),   # the descent is the best
    (0.7, 0.5, CONS_ASCENT),    # the descent lowers the loss, the ascent lowers it more
])
def test_cons_keeps_the_lowest_candidate_and_replays_without_a_forward_pass(descent, ascent, decision):
    gen = torch.Generator().manual_seed(1)
    params = [("a.weight", torch.randn(9, 7, generator=gen)), ("a.bias", torch.randn(7, generator=gen).bfloat16())]
    config = ZOConfig(optimizer="zo-sgd-cons", lr=0.05, eps=1e-2, weight_decay=0.1)
    opt = ZOOptimizer(params, config)
    initial = clone(opt.state_tensors())
    record = opt.step(Scripted([1.0, 1.3, 0.9, descent, ascent]), seed=77)
    assert record.decision == decision
    assert StepRecord.from_bytes(record.to_bytes()) == record
    trained = clone(opt.state_tensors())
    assert_same_state(replay(clone(initial), [record], config, start_step=0), trained)
    assert_same_state(replay_reference(clone(initial), [record], config, start_step=0), trained)


def test_cons_on_a_model_takes_every_decision_it_meets_exactly():
    config, initial, opt, records = train("zo-sgd-cons", "bf16", q=2, steps=8, lr=0.1)  # large steps overshoot
    assert {r.decision for r in records} == {0, 1}
    assert_same_state(replay(clone(initial), records, config, start_step=0), clone(opt.state_tensors()))


def test_perturbation_seeds_are_a_pure_function_of_the_step_seed():
    assert perturbation_seeds(2**64 - 1, 1) == (2**64 - 1,)
    seeds = perturbation_seeds(12345, 4)
    assert seeds[0] == 12345 and len(set(seeds)) == 4 and seeds == perturbation_seeds(12345, 4)
    assert perturbation_seeds(12345, 2) == seeds[:2]


def test_a_record_of_q_gradients_and_a_decision_round_trips():
    one = StepRecord(3, 9, 0.25, 1e-3, 1e-3, 7)
    assert one.size == 60 and one.to_bytes()[2] == 1  # a one-perturbation step keeps the first wire format
    many = StepRecord(3, 9, 0.25, 1e-3, 1e-3, 7, "zo-sgd-cons", (), (-1.5, 2.5e-9), CONS_DESCENT)
    data = many.to_bytes()
    assert data[2] == 2 and len(data) == many.size == 60 + 4 + 16
    assert StepRecord.from_bytes(data) == many and many.grads == (0.25, -1.5, 2.5e-9)
    with pytest.raises(ValueError, match="decision"):
        StepRecord(3, 9, 0.25, 1e-3, 1e-3, 7, "zo-sgd", decision=1)


def test_records_with_the_wrong_number_of_gradients_are_refused():
    config, initial, opt, records = train("zo-sgd", "fp32", q=2, steps=1)
    other = ZOConfig(**{**config.model_dump(), "num_perturbations": 1})
    with pytest.raises(StateMismatchError):
        replay(clone(initial), records, other, start_step=0)
    single = StepRecord(0, 1, 0.1, 1e-3, 1e-3, records[0].fingerprint)
    with pytest.raises(StateMismatchError, match="projected gradient"):
        replay(clone(initial), [single], config, start_step=0)
