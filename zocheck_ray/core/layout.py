"""The canonical layout: which tensors a state holds, in which order, at which offsets.

A state is the trainable parameters in canonical order, then the optimizer's float32 buffers, one
block per kind in the same order; a parameter's global offset (where its z is generated) is the
count of parameter elements before it. The layout and the replay-relevant config hash to the
fingerprint every `StepRecord` carries, so a record is never replayed on another state.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from zocheck_ray.core.dtypes import REPLAYED
from zocheck_ray.core.config import ZOConfig
from zocheck_ray.core.errors import StateMismatchError
from zocheck_ray.core.record import RULES_VERSION

EXP_AVG_PREFIX = "optimizer.exp_avg."
"""State key prefix of ZO-Adam's first moments."""
EXP_AVG_SQ_PREFIX = "optimizer.exp_avg_sq."
"""State key prefix of ZO-Adam's second moments."""
MOMENTUM_PREFIX = "optimizer.momentum."
"""State key prefix of ZO-SGD-MMT's momentum buffers."""
MOMENT_PREFIXES: dict[str, tuple[str, ...]] = {
    "zo-adam": (EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX),
    "zo-sgd-mmt": (MOMENTUM_PREFIX,),
}
ALL_MOMENT_PREFIXES = (EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, MOMENTUM_PREFIX)
NEW_CONFIG_DEFAULTS = {"momentum": 0.9, "num_perturbations": 1, "grad_clip": None}
"""ZOConfig fields added after the fingerprint's definition, left out at their defaults so old fingerprints hold."""


def moment_prefixes(optimizer: str) -> tuple[str, ...]:
    """The state key prefixes of `optimizer`'s float32 buffers, in state order."""
    return MOMENT_PREFIXES.get(optimizer, ())



def dtype_name(dtype: torch.dtype, where: str) -> str:
    try:
        return REPLAYED[dtype]
    except KeyError:
        raise StateMismatchError(
            f"{where} has dtype {dtype}; zocheck-ray replays float32, bfloat16 and float16 only"
        ) from None


def applies_weight_decay(name: str, shape: tuple[int, ...]) -> bool:
    """MeZO's rule (its `zo_update`), by name only."""
    return not any(word in name for word in ("bias", "layer_norm", "layernorm"))


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    """Global offset of the tensor's first element."""
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
        prefixes = moment_prefixes(config.optimizer)
        if not prefixes:
            stray = [n for n, _ in items if n.startswith(ALL_MOMENT_PREFIXES)]
            if stray:
                raise StateMismatchError(
                    f"state holds optimizer moments ({stray[0]!r}) but the config's optimizer is "
                    f"{config.optimizer!r}"
                )
            return cls.from_params(items, config.optimizer)
        per = 1 + len(prefixes)
        if len(items) % per:
            raise StateMismatchError(
                f"a {config.optimizer} state holds the parameters and, for each, "
                f"{' and '.join(p.removeprefix('optimizer.').rstrip('.') for p in prefixes)} "
                f"({per} per parameter); got {len(items)} tensors"
            )
        n = len(items) // per
        layout = cls.from_params(items[:n], config.optimizer)
        for k, prefix in enumerate(prefixes, start=1):
            block = items[k * n : (k + 1) * n]
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
        for prefix in moment_prefixes(self.optimizer):
            keys += [prefix + s.name for s in self.params]
        return keys

    def describe(self) -> list[dict]:
        """JSON-ready description (travels with every snapshot)."""
        return [
            {"name": s.name, "shape": list(s.shape), "dtype": s.dtype, "offset": s.offset, "decay": s.decay}
            for s in self.params
        ]

    def fingerprint(self, config: ZOConfig, rules: int = RULES_VERSION) -> int:
        """64-bit id of (layout, replay-relevant config, rules); records carry it. `rules`: an older version's."""
        dumped = config.model_dump(mode="json", exclude={"lr", "eps"})
        for key, default in NEW_CONFIG_DEFAULTS.items():
            if dumped.get(key) == default:
                del dumped[key]
        if rules == 1:  # its decay rule: 2-D and up, no "bias" or "norm" in the lowered name; no "rules" key
            decays = [len(s.shape) >= 2 and "bias" not in s.name.lower() and "norm" not in s.name.lower()
                      for s in self.params]
            doc = {"layout": [[s.name, list(s.shape), s.dtype, d] for s, d in zip(self.params, decays)],
                   "config": dumped}
        else:
            doc = {"layout": [[s.name, list(s.shape), s.dtype, s.decay] for s in self.params], "config": dumped,
                   "rules": rules}
        digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).digest()
        return int.from_bytes(digest[:8], "little")
