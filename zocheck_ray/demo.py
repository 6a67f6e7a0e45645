"""`zocheck-ray demo`: a short ZO fine-tune whose every step is replayed and verified exactly.

    zocheck-ray demo [--steps 200] [--optimizer zo-sgd] [--dtype fp32]

A small Hugging Face causal LM (built from config, no downloads) is fine-tuned with
MeZO on a built-in corpus. Each step yields a ~60-byte `StepRecord`. A shadow
replica, a CPU copy of the initial weights, replays the records with the fused
kernel (no forward passes) and is checked against the trainer by `state_hash`.
Halfway through, the trainer "fails": its state is thrown away and rebuilt from
the shadow's image, and the finished run must equal an uninterrupted one.
"""

from __future__ import annotations

import argparse
import time

import torch

from zocheck_ray.core import ZOConfig, ZOOptimizer, replay, state_hash
from zocheck_ray.workload.data import batch_indices, corpus_tensor, step_seed
from zocheck_ray.workload.models import build_model, trainable_parameters

def train(model, opt, data, first: int, last: int, run_seed: int, log=None):
    records = []
    for t in range(first, last):
        ids = data[batch_indices(0, t, 4, data.shape[0])]  # the batch of step t: a pure function of t
        records.append(opt.step(lambda: model(input_ids=ids, labels=ids).loss, seed=step_seed(run_seed, t)))
        if log and (t + 1) % log == 0:
            print(f"  step {t + 1:4d}  loss {opt.last_losses[0]:.4f}", flush=True)
    return records


def run(args: argparse.Namespace) -> int:
    config = ZOConfig(optimizer=args.optimizer, lr=args.lr, eps=1e-3, weight_decay=0.0)
    data = corpus_tensor(seq_len=24, vocab_size=128)

    def fresh():
        model = build_model("tiny-opt", args.dtype, seed=0)
        return model, ZOOptimizer(trainable_parameters(model), config)

    model, opt = fresh()
    with torch.no_grad():
        loss_before = float(model(input_ids=data, labels=data).loss)
    shadow = {k: v.detach().clone() for k, v in opt.state_tensors().items()}
    n_params = sum(p.numel() for p in opt.params)
    print(f"ZO fine-tune: tiny-opt ({n_params:,} params, {args.dtype}), {config.optimizer}, {args.steps} steps")

    fail_at = args.steps // 2
    start = time.perf_counter()
    records = train(model, opt, data, 0, fail_at, args.seed, log=max(1, args.steps // 10))
    train_seconds = time.perf_counter() - start
    start = time.perf_counter()
    replay(shadow, records, config, start_step=0)
    replay_seconds = time.perf_counter() - start
    assert state_hash(shadow) == state_hash(opt.state_tensors()), "shadow diverged from the trainer"

    print(f"  step {fail_at}: trainer lost; rebuilding it from the shadow's image")
    start = time.perf_counter()
    model, opt = fresh()
    opt.load_state_tensors(shadow, step=fail_at)
    recovery_seconds = time.perf_counter() - start
    records += train(model, opt, data, fail_at, args.steps, args.seed, log=max(1, args.steps // 10))
    recovered_hash = state_hash(opt.state_tensors())
    with torch.no_grad():
        loss_after = float(model(input_ids=data, labels=data).loss)

    reference_model, reference = fresh()
    train(reference_model, reference, data, 0, args.steps, args.seed)
    uninterrupted_hash = state_hash(reference.state_tensors())
    replay(shadow, records[fail_at:], config, start_step=fail_at)
    shadow_hash = state_hash(shadow)

    exact = recovered_hash == uninterrupted_hash == shadow_hash
    record_bytes = sum(r.size for r in records)
    print()
    print(f"  loss                      {loss_before:.4f} -> {loss_after:.4f}")
    print(f"  step records              {len(records)} ({record_bytes / len(records):.0f} bytes each)")
    print(f"  trainer                   {train_seconds / fail_at * 1e3:.1f} ms/step")
    print(f"  shadow replay             {replay_seconds / fail_at * 1e3:.2f} ms/step (no forward passes)")
    print(f"  recovery                  {recovery_seconds * 1e3:.0f} ms at step {fail_at}")
    print(f"  final state_hash          {recovered_hash[:16]}...")
    print(f"  recovered == uninterrupted == shadow: {'yes, bit for bit' if exact else 'NO'}")
    return 0 if exact else 1


def register(commands, bench) -> None:
    parser = commands.add_parser("demo", help="a short ZO fine-tune with exact replay and recovery",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--optimizer", choices=["zo-sgd", "zo-adam", "sparse-mezo"], default="zo-sgd")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)
