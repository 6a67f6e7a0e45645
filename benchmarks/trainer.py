"""`python -m benchmarks trainer`: the ZOCheck trainer step against a plain MeZO step.

    python -m benchmarks trainer --model opt-14m --dtype fp32 --device cpu --json trainer.json
    python -m benchmarks trainer --model opt-125m --dtype bf16 fp32 --device cuda

On one model, batch and device, in interleaved rounds (a loaded machine slows both
alike), per dtype:
- ZOCheck: `ZOOptimizer.step` (device-invariant z; on CUDA the fused Triton kernels,
  one launch per phase per dtype; on the CPU z from the fused numba generator and the
  eager operation sequence), and the `StepRecord` it returns;
- MeZO: the MeZO reference loop (Malladi et al., `zo_perturb_parameters` and
  `zo_update`): for each parameter z = `normal_` from a generator seeded with the
  step's seed, then an in-place `add_` (+eps, -2 eps, +eps, -lr * g), z regenerated
  from the seed each pass. z goes into one reused buffer (MeZO allocates one per
  tensor; reusing it only makes MeZO faster);
- the forward pair alone (the two losses both steps compute), so that
  `step - forward pair` is each method's own cost, the part ZOCheck can change.

Each figure is the best of its rounds' per-step means. On CUDA the kernel launches of
one step outside the forward passes are counted with torch's profiler. The target:
ZOCheck step <= 1.05x the MeZO step.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.common import machine, print_table, write_json
from zocheck_ray.core import ZOConfig, ZOOptimizer
from zocheck_ray.workload.models import build_model, trainable_parameters

TARGET_RATIO = 1.05

BENCH_MODELS = {
    "opt-14m": dict(hidden_size=512, num_hidden_layers=4, ffn_dim=2048, word_embed_proj_dim=512, vocab_size=2048,
                    num_attention_heads=8, max_position_embeddings=512),
    "opt-125m": dict(hidden_size=768, num_hidden_layers=12, ffn_dim=3072, word_embed_proj_dim=768, vocab_size=50272,
                     num_attention_heads=12, max_position_embeddings=2048),
}
"""OPT architectures built from config (no download): 13.9 M parameters (68 tensors) and OPT-125m's
shape (125.2 M, 196 tensors)."""


def load_model(name: str, dtype: str, device: str) -> torch.nn.Module:
    if name in BENCH_MODELS:
        model = build_model("tiny-opt", dtype, seed=0, overrides=BENCH_MODELS[name])
    else:
        model = build_model(name, dtype, seed=0)
    return model.to(device).eval()


class MezoStep:
    """The MeZO reference step: seeded `normal_` + in-place `add_`, per parameter, four passes."""

    def __init__(self, named_params, eps: float, lr: float, weight_decay: float = 0.0):
        self.named = list(named_params)
        self.eps, self.lr, self.weight_decay = eps, lr, weight_decay
        device = self.named[0][1].device
        self.generator = torch.Generator(device=device)
        self.buffers = {}
        for _, p in self.named:
            size = max(self.buffers[p.dtype].numel() if p.dtype in self.buffers else 0, p.numel())
            self.buffers[p.dtype] = torch.empty(size, dtype=p.dtype, device=device)

    def _z(self, p: torch.Tensor) -> torch.Tensor:
        return self.buffers[p.dtype][: p.numel()].view_as(p).normal_(generator=self.generator)

    def _perturb(self, seed: int, scale: float) -> None:
        self.generator.manual_seed(seed)
        for _, p in self.named:
            p.add_(self._z(p), alpha=scale * self.eps)

    @torch.no_grad()
    def step(self, closure, seed: int) -> float:
        self._perturb(seed, 1.0)
        loss_plus = float(closure())
        self._perturb(seed, -2.0)
        loss_minus = float(closure())
        self._perturb(seed, 1.0)
        grad = (loss_plus - loss_minus) / (2 * self.eps)
        self.generator.manual_seed(seed)
        for name, p in self.named:
            z = self._z(p)
            if self.weight_decay > 0 and p.dim() >= 2 and "bias" not in name and "norm" not in name:
                p.sub_(self.lr * (grad * z + self.weight_decay * p))
            else:
                p.add_(z, alpha=-self.lr * grad)
        return grad


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _per_step(fn, steps: int, device: torch.device) -> float:
    _sync(device)
    began = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return (time.perf_counter() - began) / steps


def count_kernel_launches(fn, device: torch.device) -> int | None:
    """CUDA kernels one call of `fn` launches (torch's profiler; None off CUDA or if it fails)."""
    if device.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        _sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            _sync(device)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.lower().startswith(("memcpy", "memset"))]
        return len(kernels)
    except Exception:
        return None


def bench_one(model_name: str, dtype: str, device_name: str, optimizer: str, batch: int, seq_len: int, steps: int,
              rounds: int, say=print) -> dict:
    device = torch.device(device_name)
    say(f"  {model_name} {dtype} on {device}: building two copies ...")
    zo_model = load_model(model_name, dtype, device_name)
    mezo_model = load_model(model_name, dtype, device_name)
    zo_params = trainable_parameters(zo_model)
    config = ZOConfig(optimizer=optimizer, lr=1e-6, eps=1e-3)
    began = time.perf_counter()
    opt = ZOOptimizer(zo_params, config)
    setup_seconds = time.perf_counter() - began
    mezo = MezoStep(trainable_parameters(mezo_model), config.eps, config.lr)
    vocab = zo_model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)

    def zo_closure():
        return zo_model(input_ids=ids, labels=ids).loss

    def mezo_closure():
        return mezo_model(input_ids=ids, labels=ids).loss

    seed = [0]

    def zo_step():
        seed[0] += 1
        opt.step(zo_closure, seed=seed[0])

    def mezo_step():
        seed[0] += 1
        mezo.step(mezo_closure, seed=seed[0])

    @torch.no_grad()
    def forward_pair():
        float(zo_closure())
        float(zo_closure())

    with torch.no_grad():
        for fn in (zo_step, mezo_step, forward_pair):  # warm-up: compilation, allocator, caches
            fn()
        times = {"zocheck": [], "mezo": [], "forward": []}
        for r in range(rounds):
            times["zocheck"].append(_per_step(zo_step, steps, device))
            times["mezo"].append(_per_step(mezo_step, steps, device))
            times["forward"].append(_per_step(forward_pair, steps, device))
        launches = {k: count_kernel_launches(fn, device) for k, fn in
                    (("zocheck", zo_step), ("mezo", mezo_step), ("forward", forward_pair))}
    zo, me, fw = (min(times[k]) for k in ("zocheck", "mezo", "forward"))
    params = sum(p.numel() for _, p in zo_params)
    tensors = len(zo_params)
    row = {
        "model": model_name, "dtype": dtype, "device": str(device), "optimizer": optimizer, "params": params,
        "tensors": tensors, "batch_size": batch, "seq_len": seq_len, "kernel_backend": opt.kernel_backend,
        "kernel_check": opt.kernel_check.as_dict() if opt.kernel_check is not None else None,
        "optimizer_setup_seconds": setup_seconds,
        "zocheck_step_seconds": zo, "mezo_step_seconds": me, "forward_pair_seconds": fw,
        "ratio": zo / me, "zocheck_own_seconds": zo - fw, "mezo_own_seconds": me - fw,
        "own_ratio": (zo - fw) / (me - fw) if me > fw else None,
        "rounds": {k: v for k, v in times.items()},
    }
    for k in ("zocheck", "mezo"):
        n, f = launches[k], launches["forward"]
        row[f"{k}_launches_per_step"] = n - f if n is not None and f is not None else None
        row[f"{k}_launches_per_tensor_phase"] = (n - f) / (4 * tensors) if n is not None and f is not None else None
    return row


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here; run with --device cpu")
        return 2
    info = machine()
    load_before = os.getloadavg()
    rows = []
    for dtype in args.dtype:
        rows.append(bench_one(args.model, dtype, args.device, args.optimizer, args.batch_size, args.seq_len,
                              args.steps, args.rounds))
    load_after = os.getloadavg()
    print()
    print_table(rows, [("model", "model", ""), ("dtype", "dtype", ""), ("device", "device", ""),
                       ("params", "params", ","), ("kernel_backend", "z/update", ""),
                       ("zocheck_step_seconds", "ZOCheck step s", ".4f"), ("mezo_step_seconds", "MeZO step s", ".4f"),
                       ("ratio", "ratio", ".3f"), ("forward_pair_seconds", "2 forwards s", ".4f"),
                       ("zocheck_own_seconds", "ZOCheck non-fwd s", ".4f"), ("mezo_own_seconds", "MeZO non-fwd s", ".4f"),
                       ("zocheck_launches_per_step", "ZOCheck launches", "d"),
                       ("mezo_launches_per_step", "MeZO launches", "d")])
    targets = [{"target": f"ZOCheck step <= {TARGET_RATIO}x MeZO ({r['dtype']}, {r['device']})",
                "measured": f"{r['ratio']:.3f}x", "met": r["ratio"] <= TARGET_RATIO} for r in rows]
    for r in rows:
        if r["zocheck_launches_per_tensor_phase"] is not None:
            targets.append({"target": f"<= 2 kernel launches per tensor per phase ({r['dtype']})",
                            "measured": f"{r['zocheck_launches_per_tensor_phase']:.3f}",
                            "met": r["zocheck_launches_per_tensor_phase"] <= 2})
    print("\ntargets:")
    for t in targets:
        print(f"  {'met    ' if t['met'] else 'NOT MET'}  {t['target']}: {t['measured']}")
    print(f"\nload average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f} on {info['cpu_count']} CPUs; "
          f"each figure is the best of {args.rounds} interleaved rounds of {args.steps} steps")
    write_json(args.json, {"benchmark": "trainer", "machine": info, "results": rows, "targets": targets,
                           "load_average_before": load_before, "load_average_after": load_after})
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default="opt-14m",
                        help=f"{' or '.join(BENCH_MODELS)} (built from config), or any model build_model knows "
                             "(default opt-14m)")
    parser.add_argument("--dtype", nargs="+", choices=["fp32", "bf16", "fp16"], default=["fp32"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--optimizer", choices=["zo-sgd", "zo-adam", "sparse-mezo"], default="zo-sgd")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="steps timed per round (default 3)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; figures are the best (default 5)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.set_defaults(func=run)
    return parser


def register(bench) -> None:
    add_arguments(bench.add_parser("trainer", help="the ZOCheck trainer step vs a plain MeZO step",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))


if __name__ == "__main__":  # without the CLI's other commands (and Ray): scripts/cuda_check.sh
    arguments = add_arguments(argparse.ArgumentParser(prog="python -m benchmarks.trainer")).parse_args()
    raise SystemExit(run(arguments))
