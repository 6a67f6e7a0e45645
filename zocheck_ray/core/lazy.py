"""A package whose public names load on first use (standard library only).

`zocheck-ray status`, `--help` and a job file's validation need none of torch, numba or the
model's libraries, which would dominate their start-up if the package imported every module.
"""

from __future__ import annotations

import importlib
from typing import Callable


def on_first_use(namespace: dict, modules: dict[str, tuple[str, ...]]) -> tuple[Callable, Callable]:
    """(`__getattr__`, `__dir__`) for the package whose `globals()` are `namespace`: each name of
    `modules` (submodule -> its names), and each submodule, is imported on first use."""
    package = namespace["__name__"]
    home = {name: module for module, names in modules.items() for name in names}
    namespace["__all__"] = list(home)

    def __getattr__(name: str):
        module = home.get(name)
        if module is not None:
            value = getattr(importlib.import_module(f"{package}.{module}"), name)
            namespace[name] = value
            return value
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as missing:
            if missing.name != f"{package}.{name}":
                raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
