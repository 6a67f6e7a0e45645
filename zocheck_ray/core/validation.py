"""Checks shared by every replay, run before any tensor is touched."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from zocheck_ray.core.config import ZOConfig
from zocheck_ray.core.errors import NonFiniteError, RecordSequenceError, StateMismatchError
from zocheck_ray.core.layout import Layout
from zocheck_ray.core.record import RULES_VERSION, StepRecord
from zocheck_ray.core.scalars import StepScalars


def check_replay(state: dict[str, torch.Tensor], records: Sequence[StepRecord], config: ZOConfig,
                 start_step: int | None = None) -> tuple[Layout, list[StepScalars]]:
    """Validate a replay's inputs (the first record must be at `start_step`, when given); returns the state's
    layout and each step's scalars."""
    if not isinstance(config, ZOConfig):
        raise TypeError(f"config must be a ZOConfig, got {type(config).__name__}")
    layout = Layout.from_state(state, config)
    devices = {t.device for t in state.values()}
    if len(devices) != 1:
        raise StateMismatchError(f"all state tensors must be on one device, found {sorted(map(str, devices))}")
    for name, tensor in state.items():
        if not tensor.is_contiguous():
            raise StateMismatchError(f"state[{name!r}] is not contiguous")
    fingerprint = layout.fingerprint(config)
    previous = None if start_step is None else start_step - 1
    scalars = []
    for i, record in enumerate(records):
        if not isinstance(record, StepRecord):
            raise TypeError(f"records[{i}] is a {type(record).__name__}, not a StepRecord")
        if previous is not None and record.step != previous + 1:
            what = "repeats or goes back" if record.step <= previous else "leaves a gap"
            raise RecordSequenceError(
                f"records[{i}] is step {record.step} but step {previous + 1} is next: the sequence {what}"
            )
        previous = record.step
        if record.optimizer != config.optimizer:
            raise StateMismatchError(
                f"step {record.step} was taken by {record.optimizer!r}, the config says {config.optimizer!r}"
            )
        if record.fingerprint != fingerprint:
            older = [v for v in range(1, RULES_VERSION) if record.fingerprint == layout.fingerprint(config, v)]
            if older:
                raise StateMismatchError(
                    f"step {record.step} was recorded under zocheck-ray's update rules version {older[0]}, and this "
                    f"zocheck-ray applies version {RULES_VERSION}: replaying it would reach another state. Finish "
                    "that run with the release that recorded it, or start a new run")
            raise StateMismatchError(
                f"step {record.step} was recorded for layout/config fingerprint {record.fingerprint:016x}, "
                f"this state and config have {fingerprint:016x}: the parameter names, order, shapes or "
                "dtypes, or the ZO config (optimizer, perturbation, weight decay, betas, sparsity), differ"
            )
        expected_extras = len(layout.params) if config.optimizer == "sparse-mezo" else 0
        if len(record.extras) != expected_extras:
            raise StateMismatchError(
                f"step {record.step} carries {len(record.extras)} extras, {config.optimizer} on this state "
                f"needs {expected_extras}"
            )
        if len(record.grads) != config.num_perturbations:
            raise StateMismatchError(
                f"step {record.step} carries {len(record.grads)} projected gradient(s), the config's "
                f"num_perturbations is {config.num_perturbations}"
            )
        for field in ("projected_grad", "lr", "eps"):
            if not math.isfinite(getattr(record, field)):
                raise NonFiniteError(f"step {record.step}: {field} is not finite")
        scalars.append(StepScalars.of(record, config))
    return layout, scalars
