"""Shared pieces of the benchmarks: machine description, timing, tables (terminal and Markdown),
JSON, the figures' style, and running a benchmark's own command line."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Callable, Sequence

from zocheck_ray.plotting import missing_reason, pyplot  # noqa: F401  (the figures' matplotlib, optional)


SIMD_FLAGS = ("avx512f", "avx2", "avx", "sse4_2", "sve", "asimd")
"""The widest vector extension `machine` names, first found first (x86, then Arm)."""


def cpu_identity(cpuinfo: str) -> dict:
    """The first CPU of a `/proc/cpuinfo` text: its model name, its family/model (x86; one model name may cover
    CPU generations whose kernels and copies run at different speeds) and its widest vector extension."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {"cpu": fields.get("model name"),
            "cpu_family_model": f"{fields['cpu family']}/{fields['model']}" if "cpu family" in fields else None,
            "simd": next((f for f in SIMD_FLAGS if f in flags), None)}


def machine() -> dict:
    """What the figures were measured on."""
    import numba
    import torch

    try:
        cpu = cpu_identity(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = cpu_identity("")
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        **cpu, "cpu": cpu["cpu"] or platform.processor() or "unknown",
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


def md_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec); a missing value prints as '-'."""
    out = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    for r in rows:
        cells = []
        for key, _, spec in columns:
            value = r.get(key)
            cells.append("-" if value is None else format(value, spec))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def write_json(path: str | os.PathLike | None, doc: dict) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    print(f"wrote {path}")


def report_exact_targets(doc: dict, columns: Sequence[tuple[str, str, str]], json_path) -> int:
    """Print `doc`'s rows and targets and write its JSON; the exit code: 0 when every target is met and every row
    is exact."""
    print_table(doc["results"], columns)
    for t in doc["targets"]:
        print(f"  {'met' if t['met'] else 'NOT met'}: {t['target']} ({t['measured']})")
    write_json(json_path, doc)
    return 0 if all(t["met"] for t in doc["targets"]) and all(r["exact"] for r in doc["results"]) else 1


BENCH_TASK = {"batch_size": 4, "max_length": 24, "eval_interval": 10**9, "eval_size": 4, "eval_batch_size": 4}
"""The benchmarks' task: small batches, and no held-out evaluation beyond the one before the
first step (evaluation reads the state, it is not part of what the benchmarks measure)."""


def save_opt(directory: str, hidden: int, layers: int, vocab: int = 2048) -> tuple[str, int]:
    """An OPT of `hidden` x `layers` saved with `save_pretrained` (`JobConfig(model=directory)` loads it);
    returns the directory and its parameter count."""
    from zocheck_ray.workload.models import build_model, trainable_parameters

    overrides = dict(hidden_size=hidden, num_hidden_layers=layers, ffn_dim=4 * hidden, word_embed_proj_dim=hidden,
                     vocab_size=vocab, num_attention_heads=max(1, hidden // 64))
    model = build_model("tiny-opt", "fp32", seed=0, overrides=overrides)
    model.save_pretrained(directory)
    save_byte_tokenizer(directory, vocab)
    return directory, sum(p.numel() for _, p in trainable_parameters(model))


def save_byte_tokenizer(directory: str, vocab: int) -> None:
    """The byte-level tokenizer's files beside a benchmark's model, as `tokenizer.save_pretrained` would put a
    tokenizer there: a model directory without one is refused (a pretrained model's ids are its tokenizer's), and
    these give the benchmarks the byte-level ids they always trained on."""
    from zocheck_ray.workload.tokenization import byte_tokenizer_files

    for name, text in byte_tokenizer_files(vocab).items():
        Path(directory, name).write_text(text, encoding="utf-8")


def bench_job(**fields):
    """A `JobConfig` for the benchmarks (`BENCH_TASK` unless `task` is given)."""
    from zocheck_ray.config import JobConfig

    if "task" in JobConfig.model_fields:
        fields.setdefault("task", BENCH_TASK)
    else:  # a configuration without tasks: the same batch shape
        fields.setdefault("batch_size", BENCH_TASK["batch_size"])
        fields.setdefault("seq_len", BENCH_TASK["max_length"])
    return JobConfig(**fields)


def run_command_for_json(register: Callable, name: str, argv: list[str], path: Path) -> dict:
    """Run benchmark `name` through its own command line (`register` adds it), so its defaults and
    checks apply, with `--json path`; returns the document it wrote."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    register(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args([name, *argv, "--json", str(path)])
    code = args.func(args)
    if not path.is_file():
        raise RuntimeError(f"bench {name} exited {code} without writing {path}")
    return json.loads(path.read_text())


# --------------------------------------------------------------------------- figures

STYLE = {"zocheck": ("tab:green", "o"), "log-only": ("tab:gray", "s"), "sync-checkpoint": ("tab:blue", "^"),
         "async-checkpoint": ("tab:orange", "v")}
"""Colour and marker of each strategy, the same in every figure."""
