"""The baseline ZOCheck is measured against: asynchronous full checkpoints every K steps.

    summary = run_async_checkpoint(job, fail_at=[100], every=7)
    summary["recoveries"][0]["seconds"]

This is the strategy of the paper's "async anchor" baseline (CheckFreq-style): every
K steps the trainer stages a host copy of its whole state (the critical-path cost),
and a background thread persists that copy with `SnapshotStore` while training goes
on, one write in flight. The staging buffer lives in the trainer process, so it dies
with the trainer: after a failure the restarted process loads the newest *persisted*
checkpoint and recomputes (full forward-pass ZO steps) from there to the failure.

`AsyncCheckpointTrainer` is Ray-free and runs the same model, data, seeds and
optimizer as `actors.trainer.Trainer`, so both reach the same state bit for bit;
`AsyncCheckpointActor` wraps it so that Ray restarts it after a failure, as it
restarts the ZOCheck trainer: both recoveries include the same restart cost.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import ray
import torch
from ray.exceptions import RayActorError

from zocheck_ray.actors.ray_actors import call_when_alive
from zocheck_ray.config import JobConfig
from zocheck_ray.core import ZOOptimizer, state_hash
from zocheck_ray.storage import SnapshotStore
from zocheck_ray.workload.data import batch_indices, corpus_tensor, step_seed
from zocheck_ray.workload.models import build_model, trainable_parameters

CHECKPOINT_EVERY = 7
"""The paper's baseline interval K."""


def stage(state: dict[str, torch.Tensor], out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A host copy of `state` (device-to-host on a GPU): the async checkpoint's critical path."""
    if out is None:
        return {name: t.detach().to("cpu", copy=True) for name, t in state.items()}
    for name, t in state.items():
        out[name].copy_(t.detach())
    return out


class AsyncCheckpointTrainer:
    """The unmodified ZO loop plus an asynchronous full checkpoint every `every` steps."""

    def __init__(self, job: JobConfig, url: str, every: int = CHECKPOINT_EVERY, device: str = "cpu"):
        if every < 1:
            raise ValueError(f"every must be >= 1 step, got {every}")
        started = time.perf_counter()
        self.job, self.every, self.device = job, every, torch.device(device)
        self.model = build_model(job.model, job.dtype, seed=job.run_seed).to(self.device)
        self.opt = ZOOptimizer(trainable_parameters(self.model), job.zo)
        self.data = corpus_tensor(job.seq_len, self.model.config.vocab_size).to(self.device)
        self.store = SnapshotStore(url, job.storage_options)
        self.meta = {"run_id": job.run_id, "zo_config": job.zo.model_dump(mode="json")}
        self._writer: threading.Thread | None = None
        self.stage_seconds: list[float] = []
        self.stall_seconds = 0.0
        self.persisted = 0
        load_started = time.perf_counter()
        latest = self.store.latest()
        if latest is None:  # a fresh run: the initial state is checkpoint 0, written before the first step
            self.store.save(0, stage(self.opt.state_tensors()), self.meta)
            self.recovery = {"step": 0, "source": "fresh", "load_seconds": 0.0}
        else:
            tensors, _ = self.store.load(latest)
            self.opt.load_state_tensors({k: v.to(self.device) for k, v in tensors.items()}, step=latest.step)
            self.recovery = {"step": latest.step, "source": "checkpoint",
                             "load_seconds": time.perf_counter() - load_started}
        self.recovery["seconds"] = time.perf_counter() - started

    @property
    def step(self) -> int:
        return self.opt.step_index

    def _batch(self, t: int) -> torch.Tensor:
        return self.data[batch_indices(self.job.data_seed, t, self.job.batch_size, self.data.shape[0])]

    def run(self, until_step: int, die_at_step: int | None = None) -> dict:
        """Train up to `until_step` (exclusive); `die_at_step` kills the process there (failure injection)."""
        model = self.model
        started, first = time.perf_counter(), self.step
        while self.step < until_step:
            t = self.step
            if die_at_step is not None and t == die_at_step:
                os._exit(1)  # the staging buffer and any write in flight die with the process
            ids = self._batch(t)
            self.opt.step(lambda: model(input_ids=ids, labels=ids).loss, seed=step_seed(self.job.run_seed, t))
            if self.step % self.every == 0:
                self._checkpoint()
        steps = self.step - first
        return {"step": self.step, "steps": steps, "seconds": time.perf_counter() - started,
                "stage_ms_median": statistics.median(self.stage_seconds) * 1e3 if self.stage_seconds else None,
                "stall_seconds": self.stall_seconds, "checkpoints_persisted": self.persisted}

    def _checkpoint(self) -> None:
        start = time.perf_counter()
        if self._writer is not None:  # one write in flight: the next checkpoint waits for the previous one
            self._writer.join()
        staged_at = time.perf_counter()
        self.stall_seconds += staged_at - start
        staged = stage(self.opt.state_tensors())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stage_seconds.append(time.perf_counter() - staged_at)
        step = self.step
        self._writer = threading.Thread(target=self._persist, args=(step, staged), name="async-checkpoint",
                                        daemon=True)
        self._writer.start()

    def _persist(self, step: int, staged: dict[str, torch.Tensor]) -> None:
        self.store.save(step, staged, self.meta)
        self.persisted += 1

    def state_hash(self) -> tuple[int, str]:
        return self.step, state_hash(self.opt.state_tensors())

    def close(self) -> None:
        if self._writer is not None:
            self._writer.join()


@ray.remote
class AsyncCheckpointActor:
    """`AsyncCheckpointTrainer` in a Ray actor; its constructor recovers after a restart."""

    def __init__(self, job: dict, url: str, every: int):
        job = JobConfig.model_validate(job)
        device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
        self.trainer = AsyncCheckpointTrainer(job, url, every, device=device)

    def recovery(self) -> dict:
        return self.trainer.recovery

    def run(self, until_step: int, die_at_step: int | None = None) -> dict:
        return self.trainer.run(until_step, die_at_step)

    def state_hash(self) -> tuple[int, str]:
        return self.trainer.state_hash()

    def close(self) -> None:
        self.trainer.close()


def run_async_checkpoint(job: JobConfig, fail_at: list[int], every: int = CHECKPOINT_EVERY,
                         url: str | None = None, gpus: int = 0) -> dict:
    """Run `job` under the async-checkpoint baseline on the connected Ray cluster, killing the
    trainer at each step of `fail_at`.

    A recovery's `seconds` runs from the driver seeing the failure to the restarted trainer
    being back at the failure step (restart + load + recompute), as the controller times
    ZOCheck's recoveries.
    """
    failures = sorted(set(fail_at))
    if any(not 0 < f < job.steps for f in failures):
        raise ValueError(f"fail_at steps must lie in (0, {job.steps}), got {failures}")
    url = url or job.run_url.rstrip("/") + "-async-checkpoint"
    actor = AsyncCheckpointActor.options(num_cpus=1, num_gpus=gpus,
                                         max_restarts=len(failures) + job.max_restarts).remote(
        job.model_dump(mode="json"), url, every)
    recoveries = []
    try:
        ray.get(actor.recovery.remote())
        for fail in failures:
            try:
                ray.get(actor.run.remote(fail + 1, fail))  # the trainer process exits at `fail`
            except RayActorError:
                pass
            else:
                raise RuntimeError(f"the baseline trainer survived its injected failure at step {fail}")
            started = time.perf_counter()
            info = call_when_alive(lambda: actor.recovery.remote())
            redo = ray.get(actor.run.remote(fail))
            seconds = time.perf_counter() - started
            recoveries.append({
                "failed_at_step": fail, "seconds": seconds, "checkpoint_step": info["step"],
                "recomputed_steps": fail - info["step"], "constructor_seconds": info["seconds"],
                "load_seconds": info["load_seconds"], "recompute_seconds": redo["seconds"],
                "load_average": os.getloadavg()[0],
            })
        last = ray.get(actor.run.remote(job.steps))
        ray.get(actor.close.remote())
        final_step, final_hash = ray.get(actor.state_hash.remote())
    finally:
        ray.kill(actor, no_restart=True)
    return {"strategy": f"async full checkpoint every {every} steps", "every": every, "url": url,
            "steps": final_step, "final_state_hash": final_hash, "recoveries": recoveries,
            "trainer_seconds_per_step": last["seconds"] / max(last["steps"], 1),
            "stage_ms_median": last["stage_ms_median"], "stall_seconds": last["stall_seconds"]}
