"""Workloads: Hugging Face models, tasks and data for ZO fine-tuning.

    from zocheck_ray.workload import TaskConfig, build_model, build_task, trainable_parameters

    task = build_task(TaskConfig(), "tiny-opt")      # the shipped data, every input checked
    model = build_model("tiny-opt", "fp32", seed=0)
    loss = task.loss(model, task.batch(step))        # the batch is a pure function of (data_seed, step)
    task.evaluate(model)                             # {"accuracy": ..., "loss": ...}

    task = build_task(TaskConfig(kind="sft"), "tiny-chat", rows=dataset)   # TRL's SFT formats (docs/sft.md)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zocheck_ray.core.lazy import on_first_use

if TYPE_CHECKING:
    from zocheck_ray.workload.builder import build_task, sft_fingerprint
    from zocheck_ray.workload.datafiles import SHIPPED_SST2, Row, read_rows
    from zocheck_ray.workload.errors import (
        DataFileError,
        DataFormatError,
        LabelError,
        ModelNotFoundError,
        TaskModelMismatchError,
        WorkloadError,
    )
    from zocheck_ray.workload.models import (
        PACKAGED_MODELS,
        SMALL_MODELS,
        build_model,
        model_config_dict,
        model_directory,
        model_kind,
        trainable_parameters,
    )
    from zocheck_ray.workload.sampling import split_rows
    from zocheck_ray.workload.sft.task import SFTTask
    from zocheck_ray.workload.task_config import TaskConfig
    from zocheck_ray.workload.tasks import (
        LanguageModelingTask,
        PromptClassificationTask,
        SequenceClassificationTask,
        Task,
    )
    from zocheck_ray.workload.tokenization import ByteTokenizer, HFTokenizer, load_tokenizer


__getattr__, __dir__ = on_first_use(globals(), {
    "builder": ("build_task", "sft_fingerprint"),
    "datafiles": ("SHIPPED_SST2", "Row", "read_rows"),
    "errors": (
        "DataFileError", "DataFormatError", "LabelError", "ModelNotFoundError", "TaskModelMismatchError",
        "WorkloadError",
    ),
    "models": (
        "PACKAGED_MODELS", "SMALL_MODELS", "build_model", "model_config_dict", "model_directory", "model_kind",
        "trainable_parameters",
    ),
    "sampling": ("split_rows",),
    "sft.task": ("SFTTask",),
    "task_config": ("TaskConfig",),
    "tasks": ("LanguageModelingTask", "PromptClassificationTask", "SequenceClassificationTask", "Task"),
    "tokenization": ("ByteTokenizer", "HFTokenizer", "load_tokenizer"),
})
"""The names load with their modules on first use: the job's schema loads without torch and the model's libraries."""
