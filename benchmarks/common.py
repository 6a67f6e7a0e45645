"""Shared pieces of the benchmarks: machine description, timing, tables, JSON."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Callable, Sequence


def machine() -> dict:
    """What the figures were measured on."""
    import numba
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "numba_threads": numba.config.NUMBA_NUM_THREADS,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def best_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    """Fastest of `repeats` timed calls (the least disturbed measurement)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def print_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([format(row[k], f) if row.get(k) is not None else "-" for k, _, f in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for n, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: str | os.PathLike | None, doc: dict) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    print(f"wrote {path}")


BENCH_TASK = {"batch_size": 4, "max_length": 24, "eval_interval": 10**9, "eval_size": 4, "eval_batch_size": 4}
"""The benchmarks' task: small batches, and no held-out evaluation beyond the one before the
first step (evaluation reads the state, it is not part of what the benchmarks measure)."""


def bench_job(**fields):
    """A `JobConfig` for the benchmarks (`BENCH_TASK` unless `task` is given)."""
    from zocheck_ray.config import JobConfig

    if "task" in JobConfig.model_fields:
        fields.setdefault("task", BENCH_TASK)
    else:  # a configuration without tasks: the same batch shape
        fields.setdefault("batch_size", BENCH_TASK["batch_size"])
        fields.setdefault("seq_len", BENCH_TASK["max_length"])
    return JobConfig(**fields)
