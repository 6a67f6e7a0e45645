"""Exceptions for bad workload input, raised before a model is built: `ValueError`s whose messages name the model,
file, line, field or label and say how to fix it.
"""

from __future__ import annotations

from zocheck_ray.core.errors import ZOCheckError


class WorkloadError(ZOCheckError, ValueError):
    """Base class: a model, data file or task configuration that cannot be used."""


class ModelNotFoundError(WorkloadError):
    """A model name is neither a built-in model nor a usable model directory."""


class DataFileError(WorkloadError):
    """A data file is missing, empty, undecodable or of an unknown format."""


class DataFormatError(WorkloadError):
    """A row of a data file is malformed; `path` and `line` locate it."""

    def __init__(self, path: str, line: int, problem: str):
        super().__init__(f"{path}:{line}: {problem}")
        self.path = path
        self.line = line


class LabelError(DataFormatError):
    """A row's label is not among the task's labels (the verbalizer's keys)."""

    def __init__(self, path: str, line: int, label: object, known: list[str]):
        super().__init__(path, line, f"label {label!r} is not in the verbalizer (labels {known}); "
                                     "fix the row or add the label to task.verbalizer")
        self.label = label


class TaskModelMismatchError(WorkloadError):
    """The task cannot run on the model (kind, label count, vocabulary or length)."""


class DatasetRowError(DataFormatError):
    """A row of a dataset handed over in Python is malformed; `index` is its position."""

    def __init__(self, source: str, index: int, problem: str):
        WorkloadError.__init__(self, f"{source} row {index}: {problem}")
        self.path = source
        self.line = self.index = index
