"""Bad input to the core: a clear exception naming what is wrong, before any tensor is touched."""

import math

import pydantic
import pytest
import torch

from zocheck_ray import (
    NonFiniteError, RecordSequenceError, StateMismatchError, StepRecord, ZOConfig, ZOOptimizer, replay,
    replay_reference, state_hash,
)
from zocheck_ray.core.layout import Layout

REPLAYS = [replay, replay_reference]


def small_run(optimizer="zo-sgd", steps=4):
    params = [("w.weight", torch.randn(4, 5, generator=torch.Generator().manual_seed(1))),
              ("w.bias", torch.zeros(4))]
    config = ZOConfig(optimizer=optimizer, lr=1e-2, eps=1e-2)
    opt = ZOOptimizer(params, config)
    initial = {k: v.clone() for k, v in opt.state_tensors().items()}
    records = [opt.step(lambda: sum(p.pow(2).sum() for _, p in params), seed=s) for s in range(steps)]
    return initial, records, config


@pytest.mark.parametrize("field,value,match", [
    ("optimizer", "adam", "optimizer"), ("perturbation", "uniform", "perturbation"),
    ("lr", math.nan, "lr"), ("eps", 0.0, "eps"), ("eps", math.inf, "eps"), ("betas", (0.9, 1.0), "betas"),
    ("sparsity", 1.0, "sparsity"), ("weight_decay", -0.1, "weight_decay"), ("momentum", 1.0, "momentum"),
        ("num_perturbations", 0, "num_perturbations"), ("nesterov", True, "nesterov"),
])
def test_config_rejects_bad_fields_by_name(field, value, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        ZOConfig(**{field: value})


@pytest.mark.parametrize("replay_fn", REPLAYS)
def test_records_out_of_order_or_with_a_gap_are_rejected_untouched(replay_fn):
    initial, records, config = small_run()
    before = state_hash(initial)
    for bad, match in [([records[1], records[0]], "goes back"), ([records[0], records[2]], "gap"),
                       ([records[0], records[0]], "repeats")]:
        with pytest.raises(RecordSequenceError, match=match):
            replay_fn(initial, bad, config, start_step=bad[0].step)
    with pytest.raises(RecordSequenceError, match="step 1 but step 0"):
        replay_fn(initial, records[1:], config, start_step=0)
    with pytest.raises(TypeError, match="start_step"):  # the state's step is never left out
        replay_fn(initial, records[:1], config)
    one_at_a_time = {k: v.clone() for k, v in initial.items()}
    replay_fn(one_at_a_time, records[:1], config, start_step=0)
    with pytest.raises(RecordSequenceError, match="repeats"):  # the README's loop, a record sent twice
        replay_fn(one_at_a_time, records[:1], config, start_step=1)
    assert state_hash(initial) == before


@pytest.mark.parametrize("replay_fn", REPLAYS)
def test_a_state_that_does_not_match_the_records_is_rejected_untouched(replay_fn):
    initial, records, config = small_run()
    before = state_hash(initial)
    renamed = {"v.weight" if k == "w.weight" else k: v for k, v in initial.items()}
    reordered = dict(reversed(list(initial.items())))
    reshaped = {k: (v.reshape(5, 4) if k == "w.weight" else v) for k, v in initial.items()}
    retyped = {k: v.bfloat16() for k, v in initial.items()}
    for state in (renamed, reordered, reshaped, retyped):
        with pytest.raises(StateMismatchError, match="fingerprint"):
            replay_fn(state, records, config, start_step=0)
    with pytest.raises(StateMismatchError, match="fingerprint"):
        replay_fn(initial, records, config.model_copy(update={"weight_decay": 0.5}), start_step=0)
    with pytest.raises(StateMismatchError, match="zo-sgd"):
        replay_fn(initial, records, config.model_copy(update={"optimizer": "sparse-mezo"}), start_step=0)
    with pytest.raises(StateMismatchError, match="int64"):
        replay_fn({**initial, "w.bias": torch.zeros(4, dtype=torch.int64)}, records, config, start_step=0)
    assert state_hash(initial) == before


def test_adam_state_must_hold_its_moments_in_order():
    initial, records, config = small_run("zo-adam")
    params_only = {k: v for k, v in initial.items() if not k.startswith("optimizer.")}
    with pytest.raises(StateMismatchError, match="3 per parameter"):
        replay(params_only, records, config, start_step=0)
    keys = list(initial)
    swapped = {k: initial[k] for k in keys[:2] + [keys[3], keys[2]] + keys[4:]}
    with pytest.raises(StateMismatchError, match="belongs"):
        replay(swapped, records, config, start_step=0)


def test_non_finite_record_scalars_cannot_be_built():
    _, records, _ = small_run()
    r = records[0]
    for field in ("projected_grad", "lr", "eps"):
        with pytest.raises(NonFiniteError, match=field):
            StepRecord(**{**{s: getattr(r, s) for s in StepRecord.__slots__}, field: math.nan})


def test_scalars_that_overflow_float32_are_rejected_before_touching_the_state():
    initial, records, config = small_run()
    before = state_hash(initial)
    huge = StepRecord(0, 1, 1e300, 1e-3, 1e-3, records[0].fingerprint)
    with pytest.raises(NonFiniteError, match="grad"):
        replay(initial, [huge], config, start_step=0)
    assert state_hash(initial) == before


def test_fused_replay_refuses_non_cpu_tensors_and_bad_thread_counts():
    initial, records, config = small_run()
    with pytest.raises(ValueError, match="threads"):
        replay(initial, records, config, threads=0, start_step=0)
    meta = {k: v.to("meta") for k, v in initial.items()}
    with pytest.raises(StateMismatchError, match="CPU"):
        replay(meta, records, config, start_step=0)


def test_optimizer_rejects_duplicate_names_and_bad_dtypes():
    with pytest.raises(StateMismatchError, match="twice"):
        ZOOptimizer([("a", torch.zeros(2)), ("a", torch.zeros(2))], ZOConfig())
    with pytest.raises(StateMismatchError, match="float64"):
        ZOOptimizer([("a", torch.zeros(2, dtype=torch.float64))], ZOConfig())
    with pytest.raises(StateMismatchError, match="no trainable"):
        ZOOptimizer([], ZOConfig())


def test_non_finite_loss_is_reported_with_the_step():
    opt = ZOOptimizer([("a", torch.zeros(3))], ZOConfig())
    with pytest.raises(NonFiniteError, match="step 0"):
        opt.step(lambda: float("nan"), seed=1)


def test_layout_fingerprint_covers_names_shapes_dtypes_and_config():
    base = Layout.from_params([("a", torch.zeros(2, 3))], "zo-sgd")
    config = ZOConfig()
    fps = {
        base.fingerprint(config),
        Layout.from_params([("b", torch.zeros(2, 3))], "zo-sgd").fingerprint(config),
        Layout.from_params([("a", torch.zeros(3, 2))], "zo-sgd").fingerprint(config),
        Layout.from_params([("a", torch.zeros(2, 3).half())], "zo-sgd").fingerprint(config),
        base.fingerprint(ZOConfig(perturbation="rademacher")),
    }
    assert len(fps) == 5
    assert base.fingerprint(config) == base.fingerprint(ZOConfig(lr=0.5, eps=0.1))  # per-step scalars
