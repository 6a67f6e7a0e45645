"""A package whose public names load on first use (standard library only).

`zocheck-ray status`, `--help` and a job file's validation need none of torch, numba or the model's
libraries: a package that imported all of its modules up front would load them (torch alone is about
1.5 of the 3 s `python -m zocheck_ray status` took). Such a package names its public names and their
modules, and loads each module when one of its names is first used.
"""

from __future__ import annotations

import importlib
from typing import Callable


def on_first_use(namespace: dict, modules: dict[str, tuple[str, ...]]) -> tuple[Callable, Callable]:
    """(`__getattr__`, `__dir__`) for the package whose `globals()` are `namespace`: each name of `modules`
    (submodule -> its names) from its submodule, once; a submodule used as an attribute (`package.sub` after
    `import package`) is imported too. Those names are the package's `__all__`, which `__dir__` adds."""
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
