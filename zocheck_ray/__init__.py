"""zocheck-ray: nearly free, bit-exact checkpointing for zeroth-order fine-tuning on Ray.

The public API is re-exported here; `zocheck_ray.core` runs without Ray.
"""

import sys

from zocheck_ray.core.kernel_cache import use_cache_dir  # the standard library only, as is lazy.py
from zocheck_ray.core.lazy import on_first_use  # the standard library only: runs before the check below

use_cache_dir()  # NUMBA_CACHE_DIR, before anything of the package imports numba (it reads the variable then)

_CORE = ("CorruptRecordError", "IncompleteRecordError", "Layout", "NonFiniteError", "RecordSequenceError",
         "StateMismatchError", "StepRecord", "ZOCheckError", "ZOConfig", "ZOOptimizer", "perturbation", "replay",
         "replay_reference", "state_hash")

_DEPENDENCIES = ("torch", "numpy", "numba", "ray", "pydantic", "yaml", "safetensors", "fsspec", "transformers")
"""What `python -m zocheck_ray` looks for before it runs: found, not imported (the packages load their modules on
first use: `core/lazy.py`)."""

if sys.argv[:1] == ["-m"]:  # only while `python -m zocheck_ray[.module]` imports this package
    import importlib.util

    _absent = next((name for name in _DEPENDENCIES if importlib.util.find_spec(name) is None), None)
    if _absent is not None:
        # typically a `ray job submit` entrypoint's `python3`: the one on the PATH of the `ray start` that
        # started the cluster
        sys.exit(f"zocheck-ray: {sys.executable} lacks {_absent!r}, one of zocheck-ray's dependencies: run the "
                 "Python of the environment that holds them (/path/to/.venv/bin/python -m zocheck_ray ...); a "
                 "`ray job submit` entrypoint runs in the environment its cluster was started from, so start the "
                 "cluster from the activated environment, name that environment's Python in the entrypoint, or give "
                 "the job a runtime environment whose \"pip\" installs zocheck-ray")

__version__ = "0.1.0"


__getattr__, __dir__ = on_first_use(globals(), {
    "core": _CORE,
    "config": ("JobConfig", "load_job_config", "JobConfigError"),
    "control": ("run", "RunSummary", "RunFailedError", "RunCallback", "RunStopped", "FaultPlan"),
    "zotrainer": ("ZOTrainer", "ZOTrainerCallback"),
})
"""The public surface (`__all__`), loaded on first use, so a process that imports one module of the package (a Ray
worker loading `TrainerActor`'s) loads neither torch nor Ray's control code until it uses them."""
