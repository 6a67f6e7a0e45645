"""`python -m benchmarks zotrainer`: a `ZOTrainer` step against a job file's step on the same rows.

    python -m benchmarks zotrainer --json benchmarks/results/zotrainer.json
    python -m benchmarks zotrainer --hidden 512 --layers 8 --steps 10 --rounds 5

The shipped chats (`workload/data/chat_small.jsonl`) on a Llama of `--hidden` x `--layers` with tiny-chat's
tokenizer, one trainer step (`ZOOptimizer.step` over the task's closure: collate, two forward passes, the loss)
three ways, in interleaved rounds (a loaded machine slows each alike):
- job file: task kind `sft` built from `task.data_path`, as `zocheck-ray train` builds it;
- ZOTrainer: the same rows handed over as a `datasets.Dataset` (kind `sft` again);
- ZOTrainer, your loss: the same rows with a `compute_loss_func` that computes TRL's loss (the user's
  collator path: `CollatorTask`, `Trainer.compute_loss`'s call).
Each figure is the best of its rounds' per-step means. Target: a ZOTrainer step <= 1.02x the job file's.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import machine, print_table, write_json

TARGET_RATIO = 1.02


def trl_loss(outputs, labels, num_items_in_batch=None):
    """TRL's SFT loss written as a user writes a `compute_loss_func`: summed over the trained tokens, over
    `num_items_in_batch`."""
    logits = outputs.logits[:, :-1].float()
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                              ignore_index=-100, reduction="sum")
    return total / num_items_in_batch


def _tasks(batch: int, max_length: int) -> dict:
    from datasets import Dataset

    from zocheck_ray.workload.builder import build_task
    from zocheck_ray.workload.custom import Workload
    from zocheck_ray.workload.datafiles import SHIPPED_CHATS
    from zocheck_ray.workload.task_config import TaskConfig

    config = TaskConfig(kind="sft", data_path=str(SHIPPED_CHATS), batch_size=batch, max_length=max_length,
                        eval_size=8)
    rows = Dataset.from_json(str(SHIPPED_CHATS))
    in_memory = config.model_copy(update={"data_path": None})
    return {
        "job file": build_task(config, "tiny-chat"),
        "ZOTrainer": Workload(train_rows=rows).build(in_memory, "tiny-chat"),
        "ZOTrainer, your loss": Workload(train_rows=rows, compute_loss_func=trl_loss).build(in_memory, "tiny-chat"),
    }


def run(args: argparse.Namespace) -> int:
    from zocheck_ray.core import ZOConfig, ZOOptimizer
    from zocheck_ray.workload.data import step_seed
    from zocheck_ray.workload.models import build_model, trainable_parameters

    torch.set_num_threads(args.threads)
    overrides = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=4 * args.hidden,
                     num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 128))
    tasks = _tasks(args.batch, args.max_length)
    setups = {}
    for name, task in tasks.items():
        model = build_model("tiny-chat", "fp32", seed=0, overrides=overrides)
        setups[name] = (task, model, ZOOptimizer(trainable_parameters(model), ZOConfig(lr=1e-4, eps=1e-3)))
    params = sum(p.numel() for _, p in trainable_parameters(next(iter(setups.values()))[1]))
    print(f"zotrainer: a Llama of {params / 1e6:.1f} M parameters, batch {args.batch}, max_length "
          f"{args.max_length}, {args.steps} steps x {args.rounds} rounds, {args.threads} threads")
    best = {name: float("inf") for name in setups}
    losses = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name, (task, model, opt) in setups.items():
            began = time.perf_counter()
            for _ in range(args.steps):
                t = opt.step_index
                opt.step(task.closure(model, t), seed=step_seed(0, t))
                losses[name].append(opt.last_losses[0])
            best[name] = min(best[name], (time.perf_counter() - began) / args.steps)
    base = best["job file"]
    rows = [{"path": name, "step_ms": seconds * 1e3, "ratio": seconds / base,
             "loss_difference": max(abs(a - b) for a, b in zip(losses[name], losses["job file"]))}
            for name, seconds in best.items()]
    print_table(rows, [("path", "path", "s"), ("step_ms", "step ms", ".1f"), ("ratio", "x job file", ".3f"),
                       ("loss_difference", "max |loss - job file's|", ".2e")])
    worst = max(r["ratio"] for r in rows)
    print(f"target: a ZOTrainer step <= {TARGET_RATIO}x the job file's: {'met' if worst <= TARGET_RATIO else 'MISSED'} "
          f"({worst:.3f}x)")
    write_json(args.json, {"benchmark": "zotrainer", "machine": machine(), "parameters": params,
                           "settings": vars(args) | {"func": None}, "rows": rows, "target_ratio": TARGET_RATIO,
                           "met": worst <= TARGET_RATIO})
    return 0


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", metavar="FILE")
    p.set_defaults(func=run)
    return p


def register(bench) -> None:
    add_arguments(bench.add_parser("zotrainer", help="a ZOTrainer step vs a job file's step on the same rows",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
