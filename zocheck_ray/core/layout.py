"""The canonical layout: which tensors a state holds, in which order, at which offsets.

A state is an ordered `dict[str, torch.Tensor]`: the trainable parameters in
canonical order, then (ZO-Adam) the first moments, then the second moments. A
parameter's global offset, the index z is generated at, is the number of parameter
elements before it. The layout and the replay-relevant part of the `ZOConfig` hash
to a 64-bit fingerprint that every `StepRecord` carries, so a record is never
replayed on a state it was not produced for.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from zocheck_ray.core.config import ZOConfig
from zocheck_ray.core.errors import StateMismatchError

EXP_AVG_PREFIX = "optimizer.exp_avg."
"""State key prefix of ZO-Adam's first moments (float32, one per parameter)."""
EXP_AVG_SQ_PREFIX = "optimizer.exp_avg_sq."
"""State key prefix of ZO-Adam's second moments (float32, one per parameter)."""

DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}
DTYPE_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}


def dtype_name(dtype: torch.dtype, where: str) -> str:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise StateMismatchError(
            f"{where} has dtype {dtype}; zocheck-ray replays float32, bfloat16 and float16 only"
        ) from None


def applies_weight_decay(name: str, shape: tuple[int, ...]) -> bool:
    """MeZO's rule: decay weights, never biases or normalisation weights."""
    lowered = name.lower()
    return len(shape) >= 2 and "bias" not in lowered and "norm" not in lowered


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    """Global offset of the tensor's first element in the canonical parameter order."""
    decay: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Layout:
    params: tuple[TensorSpec, ...]
    optimizer: str

    @classmethod
    def from_params(cls, named: list[tuple[str, torch.Tensor]], optimizer: str) -> "Layout":
        specs, offset, seen = [], 0, set()
        for name, tensor in named:
            if not isinstance(name, str) or not name:
                raise StateMismatchError(f"parameter names must be non-empty strings, got {name!r}")
            if name in seen:
                raise StateMismatchError(f"parameter {name!r} appears twice")
            seen.add(name)
            shape = tuple(int(d) for d in tensor.shape)
            spec = TensorSpec(name, shape, dtype_name(tensor.dtype, f"parameter {name!r}"), offset,
                              applies_weight_decay(name, shape))
            specs.append(spec)
            offset += spec.numel
        if not specs:
            raise StateMismatchError("there are no trainable parameters")
        return cls(tuple(specs), optimizer)

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], config: ZOConfig) -> "Layout":
        """The layout of a state, checking that it holds what `config` needs, in order."""
        if not isinstance(state, dict):
            raise StateMismatchError(f"state must be a dict of name -> tensor, got {type(state).__name__}")
        items = list(state.items())
        for name, tensor in items:
            if not isinstance(tensor, torch.Tensor):
                raise StateMismatchError(f"state[{name!r}] is a {type(tensor).__name__}, not a tensor")
        if config.optimizer != "zo-adam":
            stray = [n for n, _ in items if n.startswith((EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX))]
            if stray:
                raise StateMismatchError(
                    f"state holds optimizer moments ({stray[0]!r}) but the config's optimizer is "
                    f"{config.optimizer!r}"
                )
            return cls.from_params(items, config.optimizer)
        if len(items) % 3:
            raise StateMismatchError(
                f"a zo-adam state holds parameters, exp_avg and exp_avg_sq tensors (3 per parameter); "
                f"got {len(items)} tensors"
            )
        n = len(items) // 3
        layout = cls.from_params(items[:n], config.optimizer)
        for prefix, block in ((EXP_AVG_PREFIX, items[n : 2 * n]), (EXP_AVG_SQ_PREFIX, items[2 * n :])):
            for spec, (name, tensor) in zip(layout.params, block):
                if name != prefix + spec.name:
                    raise StateMismatchError(
                        f"state key {name!r} is where {prefix + spec.name!r} belongs "
                        "(moments follow the parameters in the same order)"
                    )
                if tuple(tensor.shape) != spec.shape or tensor.dtype != torch.float32:
                    raise StateMismatchError(
                        f"state[{name!r}] must be float32 of shape {spec.shape}, "
                        f"got {tensor.dtype} {tuple(tensor.shape)}"
                    )
        return layout

    @property
    def total_numel(self) -> int:
        last = self.params[-1]
        return last.offset + last.numel

    def state_keys(self) -> list[str]:
        keys = [s.name for s in self.params]
        if self.optimizer == "zo-adam":
            keys += [EXP_AVG_PREFIX + s.name for s in self.params]
            keys += [EXP_AVG_SQ_PREFIX + s.name for s in self.params]
        return keys

    def describe(self) -> list[dict]:
        """JSON-ready description (travels with every snapshot)."""
        return [
            {"name": s.name, "shape": list(s.shape), "dtype": s.dtype, "offset": s.offset, "decay": s.decay}
            for s in self.params
        ]

    def fingerprint(self, config: ZOConfig) -> int:
        """64-bit id of (layout, replay-relevant config); records carry it."""
        doc = {
            "layout": [[s.name, list(s.shape), s.dtype, s.decay] for s in self.params],
            "config": config.model_dump(mode="json", exclude={"lr", "eps"}),
        }
        digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).digest()
        return int.from_bytes(digest[:8], "little")
