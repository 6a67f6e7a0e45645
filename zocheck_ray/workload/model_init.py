"""`model_init`: a function that returns the model, as `transformers.Trainer(model_init=...)` takes it, called by
every trainer process, so that a restarted one builds it again.

    init = ModelInit.probe(make_model, seed=0)   # one call here, as Trainer makes: the config and layout
    job = JobConfig(model=register(init))         # "model_init:my_module.make_model", known to this process
    model = build_model(job.model)                # calls it again, checked to build the same architecture
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable

import torch

from zocheck_ray.workload.errors import ModelNotFoundError, WorkloadError
from zocheck_ray.workload.names import MODEL_INIT_PREFIX


def function_name(function: Callable) -> str:
    """`module.qualname` of a user's function, for the lines that name it."""
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def layout_of(model: torch.nn.Module) -> str:
    """SHA-256 of the parameters' names, shapes and dtypes, in order: what a restored state must fit."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype}\n".encode())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class ModelInit:
    """A `model_init` function and what its first call returned: the model's config, class and layout."""

    fn: Callable[[], torch.nn.Module]
    function: str
    config: dict
    architecture: str
    layout: str
    seed: int
    """torch's seed before each call, as `Trainer` seeds before `model_init`: its random weights repeat."""

    @classmethod
    def probe(cls, fn: Callable[[], torch.nn.Module], seed: int) -> ModelInit:
        if not callable(fn):
            raise WorkloadError(f"model_init must be a function that returns the model, got {type(fn).__name__}")
        name = function_name(fn)
        model = _call(fn, name, seed)
        return cls(fn, name, model.config.to_dict(), type(model).__name__, layout_of(model), seed)

    @property
    def name(self) -> str:
        """The job's `model` for it."""
        return MODEL_INIT_PREFIX + self.function

    def build(self) -> torch.nn.Module:
        model = _call(self.fn, self.function, self.seed)
        if (type(model).__name__, layout_of(model)) != (self.architecture, self.layout):
            raise WorkloadError(f"model_init {self.function} returned {type(model).__name__} with parameter layout "
                                f"{layout_of(model)[:12]}, where its first call returned {self.architecture} with "
                                f"{self.layout[:12]}: it must build the same architecture each time (a restarted "
                                "trainer calls it again)")
        return model


def _call(fn: Callable, function: str, seed: int) -> torch.nn.Module:
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = fn()
    except Exception as exc:
        raise WorkloadError(f"model_init {function} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise WorkloadError(f"model_init {function} returned {type(model).__name__}: it must return a Hugging Face "
                            "model (a torch.nn.Module with a config)")
    return model


_REGISTERED: dict[str, ModelInit] = {}
"""The `model_init` functions this process was handed, by their job `model` name."""


def register(init: ModelInit) -> str:
    """Make `init` the model of its name in this process; returns the name."""
    _REGISTERED[init.name] = init
    return init.name


def registered(name: str) -> ModelInit:
    if name not in _REGISTERED:
        raise ModelNotFoundError(f"model {name!r} is a model_init function, which only the process it was handed "
                                 "to builds (ZOTrainer's, and the run's trainers); give ZOTrainer the function")
    return _REGISTERED[name]
