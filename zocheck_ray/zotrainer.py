"""`ZOTrainer`: zeroth-order fine-tuning in the shape of Hugging Face's `Trainer`, run on Ray beside the shadow.

    from datasets import Dataset
    from zocheck_ray import ZOTrainer

    trainer = ZOTrainer(model="tiny-chat", args={"steps": 100, "peft": {"method": "lora"}},
                        train_dataset=Dataset.from_list(chats))
    trainer.train()                  # a run as `zocheck-ray train` runs a job file
    trainer.evaluate()               # {"eval_loss": ..., "eval_perplexity": ...} of the final state
    trainer.save_model("out/")       # a Hugging Face directory of the final state

`args` is the job (`JobConfig`, a dict of its fields, or a YAML file). `data_collator` and `compute_loss_func`
have `transformers.Trainer`'s meaning and signature; `callbacks` get the run's events as read-only values.
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from zocheck_ray.config import JobConfig, JobConfigError, load_job_config, with_absolute_paths
from zocheck_ray.control.callbacks import RunCallback
from zocheck_ray.control.faults import FaultPlan
from zocheck_ray.workload.custom import Workload
from zocheck_ray.workload.errors import WorkloadError
from zocheck_ray.workload.model_init import ModelInit, function_name, register


@dataclasses.dataclass(frozen=True)
class StepEvent:
    """The end of a segment of steps: its last step's loss and the shadow's state then."""

    step: int
    loss: float | None
    lag_steps: int
    snapshot_step: int | None
    durable_step: int | None


@dataclasses.dataclass(frozen=True)
class SnapshotEvent:
    """The shadow's newest snapshot (in memory) or durable snapshot moved on."""

    step: int
    durable: bool


@dataclasses.dataclass(frozen=True)
class EvaluationEvent:
    """Held-out metrics at `step`, and the greedy generations of kind `sft` ((prompt, text) pairs)."""

    step: int
    metrics: Mapping[str, float]
    samples: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class RecoveryEvent:
    """Lost trainers are back: where they were lost, where they resumed and from what."""

    failed_at_step: int
    recovered_step: int
    mode: str
    image_source: str
    replayed_records: int
    seconds: float


class ZOTrainerCallback:
    """`ZOTrainer`'s events; override any. Each gets a frozen value: a callback watches the run, never steers it."""

    def on_train_begin(self, run_id: str, step: int) -> None:
        """The run's processes are up at `step` (0, or where a resumed run goes on)."""

    def on_step(self, event: StepEvent) -> None:
        """A segment of `log_interval` steps ended."""

    def on_snapshot(self, event: SnapshotEvent) -> None:
        """A newer snapshot is in the shadow's memory, or durable."""

    def on_evaluate(self, event: EvaluationEvent) -> None:
        """A held-out evaluation finished."""

    def on_recovery(self, event: RecoveryEvent) -> None:
        """Lost trainers are back."""

    def on_train_end(self, summary) -> None:
        """The run ended; `summary` is its `RunSummary`."""


class _Events(RunCallback):
    """The run's events as `ZOTrainerCallback` values."""

    def __init__(self, callbacks: Sequence[ZOTrainerCallback]):
        self.callbacks = list(callbacks)
        self.snapshot: int | None = None
        self.durable: int | None = None
        self.evaluated: set[int] = set()

    def _each(self, name: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, name)(*args)

    def on_start(self, run, started):
        self._each("on_train_begin", run.job.run_id, started.step or 0)

    def on_segment(self, run, segment):
        progress, m = segment.progress, segment.metrics
        self._each("on_step", StepEvent(progress.step, progress.loss, m.lag_steps, m.snapshot_step, m.durable_step))
        self._news(run, m)

    def on_state(self, run, state):
        if state == "done" and run.summary is not None:  # the final state, made durable after the last segment
            self._news(run, run.summary.metrics)

    def _news(self, run, m) -> None:
        """Snapshots and evaluations not told yet (the step-0 evaluation is taken during the startup profile)."""
        for step, durable in ((m.snapshot_step, False), (m.durable_step, True)):
            if step is not None and step != (self.durable if durable else self.snapshot):
                self._each("on_snapshot", SnapshotEvent(step, durable))
        self.snapshot, self.durable = m.snapshot_step, m.durable_step
        record = run.record
        for step in sorted(set(record.evaluations) - self.evaluated):
            self.evaluated.add(step)
            samples = tuple(tuple(pair) for pair in record.samples.get(step, ()))
            self._each("on_evaluate", EvaluationEvent(step, types.MappingProxyType(dict(record.evaluations[step])),
                                                      samples))

    def on_recovery(self, run, r):
        self._each("on_recovery", RecoveryEvent(r.failed_at_step, r.recovered_step, r.mode, r.image_source,
                                                r.replayed_records, r.seconds))


def job_of(args: JobConfig | Mapping | str | Path | None, model: str | None = None, **fields: Any) -> JobConfig:
    """The job `args` names, with `model` and `fields` set."""
    if isinstance(args, JobConfig):
        base = args.model_dump(mode="json")
        path = None
    elif isinstance(args, (str, Path)):
        base, path = None, args
    elif args is None or isinstance(args, Mapping):
        base, path = dict(args or {}), None
    else:
        raise JobConfigError(f"args must be a JobConfig, a dict of its fields or a YAML file's path, got "
                             f"{type(args).__name__}")
    return with_absolute_paths(load_job_config(path, base=base, model=model, **fields))


class ZOTrainer:
    """A zeroth-order fine-tuning run with `transformers.Trainer`'s arguments, exact through every recovery."""

    def __init__(self, model: str | Callable | None = None, args: JobConfig | Mapping | str | Path | None = None,
                 train_dataset: Sequence[Mapping] | None = None, eval_dataset: Sequence[Mapping] | None = None,
                 processing_class: Any = None, data_collator: Callable | None = None,
                 compute_loss_func: Callable | None = None, callbacks: Sequence[ZOTrainerCallback] | None = None,
                 model_init: Callable | None = None):
        """`model`: a job's `model` (None: `args`'s), or a `model_init` function each trainer process calls, torch
        seeded from `run_seed`; rows handed over make the task kind `sft` unless `args` names another."""
        if model_init is not None:
            if model is not None:
                raise JobConfigError("give model or model_init, not both")
            model = model_init
        kind = {"task": {"kind": "sft"}} if train_dataset is not None and not _names_kind(args) else {}
        init = None
        if callable(model):
            try:
                init = ModelInit.probe(model, job_of(_merged(args, kind)).run_seed)
            except WorkloadError as exc:
                raise JobConfigError(str(exc)) from exc
            model = register(init)
        elif model is not None and not isinstance(model, (str, Path)):
            raise JobConfigError(f"model must be a model name, a model directory or a model_init function, got "
                                 f"{type(model).__name__}")
        self.args = job_of(_merged(args, kind), str(model) if model is not None else None)
        for name, fn in (("data_collator", data_collator), ("compute_loss_func", compute_loss_func)):
            if fn is not None and not callable(fn):
                raise JobConfigError(f"{name} must be a function, got {type(fn).__name__}")
        self.workload = Workload(train_dataset, eval_dataset, processing_class, data_collator, compute_loss_func, init)
        self.callbacks = list(callbacks or [])
        self.summary = None
        """The last `train`'s `RunSummary`."""

    def train(self, address: str | None = None, progress: Callable[[str], None] | None = print,
              faults: FaultPlan | None = None):
        """Run the job on the Ray cluster of `address` and return its `RunSummary`, resuming exactly a run its
        storage holds; `faults`: failures dealt on purpose. In a Ray Tune trainable the run is the trial's
        (`zocheck_ray.tune.run_trial`). Raises `JobConfigError` before any actor starts, `RunFailedError` when the
        run fails."""
        from zocheck_ray.control import run
        from zocheck_ray.tune import run_trial, trial_id

        events = _Events(self.callbacks)
        if (trial := trial_id()) is not None:  # a Ray Tune trainable's: the trial's resources, reports, restores
            job = self.args.model_copy(update={"run_id": f"{self.args.run_id}-{trial}"})
            self.summary = run_trial(job, [events], self.workload, progress)
        else:
            self.summary = run(self.args, progress=progress, callbacks=[events], address=address,
                               workload=self.workload, faults=faults)
        for callback in self.callbacks:
            callback.on_train_end(self.summary)
        return self.summary

    def evaluate(self) -> dict[str, float]:
        """The final state's held-out metrics and step, `eval_`-prefixed as `Trainer.evaluate` returns them."""
        if self.summary is None:
            raise RuntimeError("evaluate() reports the trained state: call train() first")
        metrics = self.summary.evaluations.get(self.summary.steps) or {}
        return {**{f"eval_{k}": v for k, v in metrics.items()}, "step": self.summary.steps}

    def save_model(self, output_dir: str | Path) -> Path:
        """Write the run's newest durable state as a Hugging Face directory, with `processing_class`'s files, that
        `from_pretrained` (or `PeftModel.from_pretrained` for an adapter) loads."""
        from zocheck_ray.core.hashing import state_hash
        from zocheck_ray.storage.cli import write_model_dir
        from zocheck_ray.storage.recovery import recover

        job = self.args
        result = recover(job.run_url, storage_options=job.storage_options)
        write_model_dir(str(output_dir), result, state_hash(result.state), job.run_url)
        tokenizer = self.workload.tokenizer
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):  # as Trainer.save_model saves it
            tokenizer.save_pretrained(str(output_dir))
        return Path(output_dir)

    def __repr__(self) -> str:
        functions = [f"{n}={function_name(f)}" for n, f in (("data_collator", self.workload.data_collator),
                                                              ("compute_loss_func", self.workload.compute_loss_func))
                     if f is not None]
        return f"ZOTrainer(run_id={self.args.run_id!r}, model={self.args.model!r}{''.join(', ' + f for f in functions)})"


def _names_kind(args) -> bool:
    if isinstance(args, JobConfig):
        return "kind" in args.task.model_fields_set
    if isinstance(args, Mapping):
        return "kind" in dict(args.get("task") or {})
    return isinstance(args, (str, Path))  # a job file says what it says


def _merged(args, extra: dict):
    if not extra or isinstance(args, (str, Path)):
        return args
    doc = args.model_dump(mode="json") if isinstance(args, JobConfig) else dict(args or {})
    doc["task"] = {**dict(doc.get("task") or {}), **extra["task"]}
    return doc
