"""The runs a recovered run must equal, bit for bit at every step: plain ZO loops without Ray or failures,
each computed once per process (a test module's runs mostly share one job).
"""

from __future__ import annotations

import functools
import json
from typing import Callable

from zocheck_ray.config import JobConfig
from zocheck_ray.core import ZOOptimizer, state_hash
from zocheck_ray.runtime.parallel.shards import reduce_in_shard_order, shard_count
from zocheck_ray.workload.data import step_seed
from zocheck_ray.workload.adapters import build_trainable
from zocheck_ray.workload.builder import build_task
from zocheck_ray.workload.models import SMALL_MODELS


def _model_and_optimizer(job: JobConfig):
    built = build_trainable(job.model, job.dtype, job.run_seed, job.peft, quantization=job.quantization)
    return built.model, ZOOptimizer(built.parameters, job.zo)


def _computed_once(fn: Callable[..., dict[int, str]]):
    """`fn`'s hashes for the job, computed once per process unless the job reads files or brings its own `task`."""
    memo: dict[str, dict[int, str]] = {}

    @functools.wraps(fn)
    def wrapper(job: JobConfig, task=None) -> dict[int, str]:
        if task is not None or job.model not in SMALL_MODELS or job.task.data_path is not None \
                or job.task.eval_path is not None:
            return fn(job, task)
        key = json.dumps(job.model_dump(mode="json", include={"model": True, "dtype": True, "run_seed": True,
                                                              "peft": True, "zo": True, "task": True, "steps": True,
                                                              "scaling": {"trainers"}}), sort_keys=True)
        if key not in memo:
            memo[key] = fn(job, None)
        return dict(memo[key])

    return wrapper


@_computed_once
def uninterrupted_hashes(job: JobConfig, task=None) -> dict[int, str]:
    """The run that would have happened: a plain loop, no Ray, no failures (`task`: the run's, if not the job's)."""
    model, opt = _model_and_optimizer(job)
    task = task if task is not None else build_task(job.task, job.model)
    hashes = {0: state_hash(opt.state_tensors())}
    for t in range(job.steps):
        opt.step(task.closure(model, t), seed=step_seed(job.run_seed, t))
        hashes[t + 1] = state_hash(opt.state_tensors())
    return hashes


@_computed_once
def uninterrupted_data_parallel_hashes(job: JobConfig, task=None) -> dict[int, str]:
    """The one-trainer S-shard run every data-parallel run must equal, whatever its ranks: shard sums added in shard
    order in float64."""
    shards = shard_count(job)
    if shards == 1:
        return uninterrupted_hashes(job, task)
    model, opt = _model_and_optimizer(job)
    task = task if task is not None else build_task(job.task, job.model)
    hashes = {0: state_hash(opt.state_tensors())}
    for t in range(job.steps):
        closures = [task.slice_closure(model, t, shard, shards) for shard in range(shards)]
        opt.step(lambda: [closure() for closure in closures], seed=step_seed(job.run_seed, t),
                 combine=reduce_in_shard_order)
        hashes[t + 1] = state_hash(opt.state_tensors())
    return hashes
