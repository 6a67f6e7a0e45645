"""The embedded default job: what `zocheck-ray train` runs with no `--config` (and `make demo`).

    zocheck-ray train                     # or: zocheck-ray demo, make demo
    zocheck-ray train --steps 60 --storage /tmp/runs

It needs no download. It fine-tunes `tiny-opt` with MeZO on language modelling (a model this small
learns no sentiment from random weights), kills the trainer once at 60% of the steps, recovers,
checks every step's state against the durable log, and prints a table.
"""

from __future__ import annotations

EMBEDDED_DEFAULT: dict = {
    "model": "tiny-opt",
    "steps": 300,
    "zo": {"optimizer": "zo-sgd", "lr": 5e-3, "eps": 1e-3},
    "task": {"kind": "lm", "text_field": "sentence", "batch_size": 16, "eval_interval": 50},
    "log_interval": 25,
    "hash_every_step": True,
}
"""The job fields of the embedded default (the rest are `JobConfig`'s defaults)."""

FAILURE_FRACTION = 0.6
"""The embedded default kills the trainer once, at this fraction of its steps."""


def describe(job) -> str:
    return (f"no --config: the embedded default job: {job.model} ({job.dtype}) fine-tuned with {job.zo.optimizer} "
            f"(lr {job.zo.lr:g}, eps {job.zo.eps:g}) on {job.task.kind} over the shipped sentiment sentences, "
            f"{job.steps} steps, storage {job.run_url}")

