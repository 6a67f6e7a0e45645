"""Reading task rows from JSONL, CSV or Parquet files or a `datasets` folder, with errors that name the
file and line.

    rows = read_rows("train.jsonl", text_field="sentence", label_field="label")
    records = read_records("rte_saved/", split="train")  # every field; a `save_to_disk` folder
    records = memory_records(dataset)                     # a datasets.Dataset handed over

Nothing is coerced silently: a float, boolean or null label is an error (CSV's text "1" matches key 1).
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple, Sequence

from zocheck_ray.workload.errors import DataFileError, DataFormatError, DatasetRowError, WorkloadError
from zocheck_ray.workload.task_config import MEZO_KINDS, DataFormat, TaskConfig

SHIPPED_SST2 = Path(__file__).resolve().parent / "data" / "sst2_small.jsonl"
SHIPPED_CHATS = Path(__file__).resolve().parent / "data" / "chat_small.jsonl"
"""The shipped chats (kind `sft`'s default): 160 short conversations, a quarter with a system message."""
"""The shipped sentiment dataset: 480 short movie-review sentences, labels 0 (negative) and 1 (positive)."""

_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}


class Splits(NamedTuple):
    """What each stage of `build_task` hands on."""

    train: list
    held: list | None
    """None: sampling holds them out of `train`."""
    dev: list


@dataclass(frozen=True)
class Where:
    """A record's place: `path:line` of a file, or `<source> row <index>` of rows handed over in Python."""

    source: str
    index: int
    in_file: bool = True

    def __str__(self) -> str:
        return f"{self.source}:{self.index}" if self.in_file else f"{self.source} row {self.index}"

    def error(self, problem: str) -> DataFormatError:
        """The error for a problem with this record, naming it."""
        return DataFormatError(self.source, self.index, problem) if self.in_file else \
            DatasetRowError(self.source, self.index, problem)


InMemoryRows = Sequence[dict]
"""Rows handed over in Python: a `datasets.Dataset` or a list of dicts (or a `DatasetDict` of them)."""


@dataclass(frozen=True)
class Row:
    """A text, its label as written (None: unlabelled) and where it came from."""

    text: str
    label: int | str | None
    path: str
    line: int


def data_format(path: str | Path, declared: DataFormat = "auto") -> Literal["jsonl", "csv", "parquet", "dataset"]:
    """The format of `path`: `declared`, or with `auto` by suffix, a folder being a `save_to_disk` one."""
    if declared != "auto":
        return declared
    if Path(path).is_dir():
        return "dataset"
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIXES:
        raise DataFileError(f"cannot tell the format of data file {path} from its suffix {suffix!r}; "
                            "name it .jsonl, .csv or .parquet, give a save_to_disk folder, or set task.data_format")
    return _SUFFIXES[suffix]  # type: ignore[return-value]


def read_records(path: str | Path, fmt: DataFormat = "auto", split: str = "train") -> list[tuple[int, dict]]:
    """(line, record) of every row of a JSONL or Parquet file or a `save_to_disk` folder's `split`."""
    path = Path(path)
    kind = data_format(path, fmt)
    if kind == "csv":
        raise DataFileError(f"data file {path}: this task reads structured rows; give JSONL, Parquet or a "
                            "save_to_disk folder")
    if kind == "jsonl":
        text = _read_text(path)
        out = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFormatError(str(path), number, f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(record, dict):
                raise DataFormatError(str(path), number, f"expected a JSON object, got {type(record).__name__}")
            out.append((number, record))
    else:
        out = [(i + 1, dict(r)) for i, r in enumerate(_read_table(path, kind, split))]
    if not out:
        raise DataFileError(f"data file {path} holds no rows" + (f" in split {split!r}" if kind == "dataset" else ""))
    return out


def has_split(path: str | Path, split: str, fmt: DataFormat = "auto") -> bool:
    """Whether `path` is a `save_to_disk` folder of several splits, one of them `split`."""
    if data_format(path, fmt) != "dataset":
        return False
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception:
        return False
    return isinstance(loaded, datasets.DatasetDict) and split in loaded


def _read_table(path: Path, kind: str, split: str):
    """A Parquet file or a `save_to_disk` folder as a `datasets.Dataset` (local files only)."""
    import datasets

    if kind == "parquet":
        if not path.is_file():
            raise DataFileError(f"data file {path} does not exist (or is not a file)")
        try:
            return datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
        except Exception as exc:
            raise DataFileError(f"data file {path} is not a readable Parquet file: {exc}") from exc
    if not path.is_dir():
        raise DataFileError(f"data folder {path} does not exist (a save_to_disk folder is a directory)")
    try:
        loaded = datasets.load_from_disk(str(path), keep_in_memory=True)
    except Exception as exc:
        raise DataFileError(f"{path} is not a folder written by datasets' save_to_disk: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataFileError(f"{path} has splits {sorted(loaded)}, not {split!r}; set task.split / task.eval_split")
        return loaded[split]
    return loaded


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise DataFileError(f"data file {path} does not exist (or is not a file)")
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise DataFormatError(str(path), line, f"not valid UTF-8 ({exc.reason})") from exc


def _check_text(path: str, line: int, field: str, value: object) -> str:
    if not isinstance(value, str):
        raise DataFormatError(path, line, f"field {field!r} must be a string, got {type(value).__name__} {value!r}")
    if not value.strip():
        raise DataFormatError(path, line, f"field {field!r} is empty")
    return value


def _check_label(path: str, line: int, field: str, value: object) -> int | str:
    # bool is an int subclass, and 1.0 or null are almost always a broken export: refuse them.
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise DataFormatError(path, line, f"field {field!r} must be an integer or a string, "
                                          f"got {type(value).__name__} {value!r}")
    return value


def _jsonl_rows(path: str, text: str, text_field: str, label_field: str | None) -> list[Row]:
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataFormatError(path, number, f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(record, dict):
            raise DataFormatError(path, number, f"expected a JSON object, got {type(record).__name__}")
        for field in (text_field, label_field):
            if field is not None and field not in record:
                raise DataFormatError(path, number, f"missing field {field!r} (the row has {sorted(record)}); "
                                                    "fix the row or set task.text_field / task.label_field")
        label = None if label_field is None else _check_label(path, number, label_field, record[label_field])
        rows.append(Row(_check_text(path, number, text_field, record[text_field]), label, path, number))
    return rows


def _csv_rows(path: str, text: str, text_field: str, label_field: str | None) -> list[Row]:
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader)
    except StopIteration:
        return []
    except csv.Error as exc:
        raise DataFormatError(path, reader.line_num, f"malformed CSV header ({exc})") from exc
    columns = {name.strip(): i for i, name in enumerate(header)}
    for field in (text_field, label_field):
        if field is not None and field not in columns:
            raise DataFormatError(path, 1, f"the header has no column {field!r} (columns {list(columns)}); "
                                           "fix the header or set task.text_field / task.label_field")
    rows = []
    while True:
        start = reader.line_num + 1
        try:
            cells = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            raise DataFormatError(path, start, f"malformed CSV row ({exc})") from exc
        if not cells or all(not c.strip() for c in cells):
            continue
        if len(cells) != len(header):
            raise DataFormatError(path, start, f"expected {len(header)} columns as in the header, got {len(cells)}")
        label = None if label_field is None else cells[columns[label_field]].strip()
        if label == "":
            raise DataFormatError(path, start, f"field {label_field!r} is empty")
        rows.append(Row(_check_text(path, start, text_field, cells[columns[text_field]]), label, path, start))
    return rows


def read_rows(path: str | Path, text_field: str = "sentence", label_field: str | None = "label",
              fmt: DataFormat = "auto", split: str = "train") -> list[Row]:
    """All rows of a file or a `save_to_disk` folder's split; `label_field=None` reads text only."""
    path = Path(path)
    kind = data_format(path, fmt)
    if kind in ("parquet", "dataset"):
        rows = []
        for number, record in read_records(path, kind, split):
            for field in (text_field, label_field):
                if field is not None and field not in record:
                    raise DataFormatError(str(path), number, f"missing field {field!r} (the row has {sorted(record)}); "
                                                             "set task.text_field / task.label_field")
            label = None if label_field is None else _check_label(str(path), number, label_field, record[label_field])
            rows.append(Row(_check_text(str(path), number, text_field, record[text_field]), label, str(path), number))
        return rows
    text = _read_text(path)
    reader = _jsonl_rows if kind == "jsonl" else _csv_rows
    rows = reader(str(path), text, text_field, label_field)
    if not rows:
        raise DataFileError(f"data file {path} holds no rows")
    return rows


def memory_records(rows: InMemoryRows, source: str = "dataset") -> list[tuple[Where, object]]:
    """(where, record) of every row handed over in Python; errors name `<source> row <index>`."""
    if isinstance(rows, (str, bytes, Path, dict)) or not hasattr(rows, "__len__"):
        raise WorkloadError(f"rows handed over in Python must be a datasets.Dataset or a list of dicts, got "
                            f"{type(rows).__name__}; a file's path goes to task.data_path")
    if len(rows) == 0:
        raise WorkloadError(f"the {source} handed over holds no rows")
    return [(Where(source, i, False), record) for i, record in enumerate(rows)]


def _is_dataset_dict(rows: object) -> bool:
    return isinstance(rows, dict) or type(rows).__name__ in ("DatasetDict", "IterableDatasetDict")


def _sft_splits(config: TaskConfig, rows: InMemoryRows | None, eval_rows: InMemoryRows | None) -> Splits:
    """Kind sft's (where, record) pairs: from `task.data_path` (and `eval_path` or `eval_split`) or in memory."""
    if rows is None:
        def read(where, split):
            return [(Where(str(where), line), record) for line, record in read_records(where, config.data_format,
                                                                                        split)]
        train = read(config.data_path or SHIPPED_CHATS, config.split)
        if config.eval_path is not None:
            return Splits(train, read(config.eval_path, config.eval_split), [])
        if config.data_path is not None and has_split(config.data_path, config.eval_split, config.data_format):
            return Splits(train, read(config.data_path, config.eval_split), [])
        return Splits(train, None, [])
    if config.data_path is not None or config.eval_path is not None:
        raise WorkloadError("rows were handed to build_task and task.data_path/eval_path are set too; give one")
    source, held_source = "dataset", "eval dataset"
    if _is_dataset_dict(rows):
        for split in (config.split, *([config.eval_split] if eval_rows is None else [])):
            if split not in rows:
                raise WorkloadError(f"the DatasetDict handed over has splits {sorted(rows)}, not {split!r}; set "
                                    "task.split / task.eval_split")
        if eval_rows is None:
            eval_rows, held_source = rows[config.eval_split], f"dataset[{config.eval_split!r}]"
        rows, source = rows[config.split], f"dataset[{config.split!r}]"
    held = None if eval_rows is None else memory_records(eval_rows, held_source)
    return Splits(memory_records(rows, source), held, [])


def read_splits(config: TaskConfig, rows: InMemoryRows | None = None, eval_rows: InMemoryRows | None = None) -> Splits:
    """(line, record) pairs for MeZO's kinds, (`Where`, record) for kind sft (whose rows may be handed over in
    Python: `rows`, `eval_rows`), else `Row`s; held out: `eval_path`'s, else `eval_split`'s."""
    if config.kind == "sft":
        return _sft_splits(config, rows, eval_rows)
    if rows is not None or eval_rows is not None:
        raise WorkloadError(f"rows handed to build_task are SFT rows (task.kind 'sft'); kind {config.kind!r} reads "
                            "task.data_path")
    path = config.data_path or SHIPPED_SST2
    if config.kind in MEZO_KINDS:
        def read(where, split):
            return read_records(where, config.data_format, split)
    else:
        label_field = None if config.kind == "lm" else config.label_field

        def read(where, split):
            return read_rows(where, config.text_field, label_field, config.data_format, split)
    train = read(path, config.split)
    if config.eval_path is not None:
        return Splits(train, read(config.eval_path, config.eval_split), [])
    if has_split(path, config.eval_split, config.data_format):
        return Splits(train, read(path, config.eval_split), [])
    return Splits(train, None, [])
