"""The embedded default job: what `zocheck-ray train` runs with no `--config` (and `make demo`).

    zocheck-ray train                     # or: zocheck-ray demo, make demo
    zocheck-ray train --steps 60 --storage /tmp/runs

Everything it needs ships with the package, so it runs on a fresh machine with no
downloads: a local Ray instance, durable storage under `./runs/`, `tiny-opt` (an OPT
causal LM built from its config, ~23k parameters) and the shipped sentiment
sentences. It fine-tunes with MeZO (zo-sgd) on language modelling of those
sentences, kills the trainer once at 60% of the steps (Ray restarts it and it
recovers from the shadow's image), replays the durable log to check every step's
state, and prints the final table.

Why language modelling and not sentiment accuracy: from random weights, a model this
small does not learn the sentiment task with zeroth-order steps within a
demonstration's budget (its held-out accuracy stays at chance); its held-out
language-modelling loss falls clearly (about 4.85 -> 3.5 nats in 300 steps). Run the
sentiment task (`task.kind: sst2`, the default task of a job file) on a pretrained
model directory to see accuracy rise.
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
"""The job fields of the embedded default (the rest are `JobConfig`'s defaults); `--set` and
`--steps`/`--storage` override them."""

FAILURE_FRACTION = 0.6
"""The embedded default kills the trainer once, at this fraction of its steps."""


def default_failures(steps: int, first_allowed: int) -> list[int]:
    """The embedded default's injected failure: one, at 60% of the run, after the startup profile."""
    step = max(round(FAILURE_FRACTION * steps), first_allowed)
    return [step] if step < steps else []


def describe(job) -> str:
    return (f"no --config: the embedded default job: {job.model} ({job.dtype}) fine-tuned with {job.zo.optimizer} "
            f"(lr {job.zo.lr:g}, eps {job.zo.eps:g}) on {job.task.kind} over the shipped sentiment sentences, "
            f"{job.steps} steps, storage {job.run_url}")

