"""`python -m benchmarks quantized`: memory with a quantized frozen base, side by side in one run.

    python -m benchmarks quantized --json benchmarks/results/quantized.json
    python -m benchmarks quantized --hidden 512 --layers 4 --configs fp32-lora nf4-qzo

A Llama built from its config and saved with `save_pretrained` (nothing downloaded) is trained for a
few ZO-SGD steps under each configuration, each in a fresh Python process: an fp32 base, a bf16 base
and bitsandbytes 8-bit and 4-bit (nf4) bases under LoRA (r=8, peft's default modules), and QZO on the
4-bit base (its absmax scales trained). A baseline process, measured in the same run, imports the same
libraries and builds the same task without a model; every peak is over it. Per configuration:

- the trainer's peak resident set while it trains (`VmHWM`, reset after the load, the heap's free pages
  given back first: `malloc_trim`) and while it loads, over the baseline, and the rise while it trains;
  with `--device cuda` also the device's `memory_allocated` after the load and `max_memory_allocated`
  while it trains (the model is there);
- the base's bytes as loaded (quantized data, scales, and the unquantized embeddings and norms), and
  per parameter of the quantized linear layers;
- the trained state's bytes, the shadow's peak of state-sized memory (its replica and one image, by its
  own accounting: `ShadowMetrics.peak_held_bytes`) and a durable snapshot's bytes on storage, from a
  run of the trainer and the shadow in process (`testing.in_process`), whose final state must equal the
  plain loop's (`exact`).

docs/benchmarks.md turns the per-parameter bytes into what fits a 24 GB and an 80 GB GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchmarks.common import machine, report_exact_targets

CONFIGS = {
    "fp32-lora": ("fp32", None, "lora"),
    "bf16-lora": ("bf16", None, "lora"),
    "int8-lora": ("bf16", {"backend": "bitsandbytes", "bits": 8}, "lora"),
    "nf4-lora": ("bf16", {"backend": "bitsandbytes", "bits": 4}, "lora"),
    "nf4-qzo": ("bf16", {"backend": "bitsandbytes", "bits": 4}, "qzo"),
}
"""Name -> (dtype of what is not quantized, quantization, what is trained)."""
SHADOW_BUDGET = 2.1
"""The shadow's peak, in trained states (its replica and one image: 2x for ZO-SGD, and a margin)."""


def _job(spec: dict, storage: str):
    from zocheck_ray.config import JobConfig

    dtype, quantization, method = CONFIGS[spec["config"]]
    qzo = method == "qzo"
    return JobConfig.model_validate(dict(
        model=spec["model"], dtype=dtype, quantization=quantization, steps=spec["steps"], storage=storage,
        peft={"method": "qzo"} if qzo else {"method": "lora", "r": 8, "lora_alpha": 16},
        zo=dict(lr=1e-7, eps=1e-3, grad_clip=100.0) if qzo else dict(lr=1e-4, eps=1e-3),
        shadow=dict(snapshot_interval=2, max_lag_steps=10**6), durability=dict(durable_interval=2), log_interval=2,
        task=dict(kind="lm", data_path=spec["data"], text_field="text", tokenizer="byte", batch_size=1,
                  max_length=spec["tokens"], eval_size=1, eval_interval=10**9)))


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Llama's linear layers, the ones a backend quantizes (the embeddings, the head and the norms it leaves)."""


def _in_projection(name: str) -> bool:
    parts = name.split(".")
    return any(p in PROJECTIONS for p in parts) and not any(p in ("lora_A", "lora_B") for p in parts)


def _tensor_bytes(model) -> tuple[int, int, int]:
    """(bytes of the linear layers' tensors as loaded, their weights' element count, bytes of the rest)."""
    from zocheck_ray.workload.quantized.load import _plain

    linear_bytes = linear_params = other = 0
    for key, value in model.state_dict().items():
        size = sum(t.numel() * t.element_size() for _, t in _plain(key, value))
        if _in_projection(key):
            linear_bytes += size
        else:
            other += size
    for name, module in model.named_modules():
        leaf = not any(hasattr(child, "in_features") for child in module.children())  # not LoRA's wrapper
        if _in_projection(name) and hasattr(module, "in_features") and leaf:
            linear_params += module.in_features * module.out_features
    return linear_bytes, linear_params, other


def _child(spec: dict) -> dict:
    """One configuration (or the baseline): its peaks over what it had before the model."""
    import torch

    from benchmarks.memory import peak_host_bytes, reset_peak
    from zocheck_ray.core import ZOOptimizer, state_hash
    from zocheck_ray.workload.adapters import build_trainable
    from zocheck_ray.workload.builder import build_task
    from zocheck_ray.workload.data import step_seed

    import bitsandbytes  # noqa: F401  (every child imports the same libraries)
    import peft  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    torch.set_num_threads(spec["threads"])
    with tempfile.TemporaryDirectory(prefix="zocheck-quantized-") as storage:
        job = _job({**spec, "config": spec.get("config") or "fp32-lora"}, storage)
        task = build_task(job.task, job.model)
        _trim()
        reset_peak()
        baseline = peak_host_bytes()
        if spec.get("config") is None:
            return {"baseline_bytes": baseline}
        device = spec.get("device", "cpu")
        built = build_trainable(job.model, job.dtype, job.run_seed, job.peft, device=device,
                                quantization=job.quantization)
        load_peak = peak_host_bytes()
        opt = ZOOptimizer(built.parameters, job.zo)
        _trim()
        reset_peak()
        loaded = peak_host_bytes()
        gpu = {}
        if device == "cuda":
            torch.cuda.synchronize()
            gpu["gpu_after_load_bytes"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        for t in range(job.steps):
            opt.step(task.closure(built.model, t), seed=step_seed(job.run_seed, t))
        train_peak = peak_host_bytes()
        if device == "cuda":
            gpu["gpu_train_peak_bytes"] = torch.cuda.max_memory_allocated()
        base = built.model.get_base_model() if hasattr(built.model, "get_base_model") else built.model
        linear_bytes, linear_params, other_bytes = _tensor_bytes(base)
        final = state_hash(opt.state_tensors())
        del built, opt, base
        run = _in_process(job)
    return {"baseline_bytes": baseline, "load_peak_bytes": load_peak, "train_peak_bytes": train_peak,
            "resident_after_load_bytes": loaded, "train_rise_bytes": train_peak - loaded, **gpu,
            "linear_bytes": linear_bytes, "linear_params": linear_params, "other_bytes": other_bytes, **run,
            "exact": run["final_hash"] == final}


def _trim() -> None:
    """Give the heap's free pages back (glibc), so a peak counts what is held, not what a load freed."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peaks then include the load's freed pages
        pass


def _in_process(job) -> dict:
    from zocheck_ray.storage import snapshot_dir
    from zocheck_ray.testing.in_process import run_in_process

    run = run_in_process(job)
    m = run.metrics
    root = os.path.join(job.run_url, snapshot_dir(m.durable_step))
    snapshot = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)
    return {"state_bytes": m.state_bytes, "shadow_peak_bytes": m.peak_held_bytes, "snapshot_bytes": snapshot,
            "final_hash": run.final_hash}


def _run_child(spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.quantized", "--child", json.dumps(spec)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"quantized child {spec.get('config')} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_llama(root: str, hidden: int, layers: int, vocab: int) -> tuple[str, int]:
    """A Llama saved with `save_pretrained` under `root`; (its directory, its parameters)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                      intermediate_size=hidden * 8 // 3 // 64 * 64, num_attention_heads=hidden // 64,
                                      num_key_value_heads=hidden // 64, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    directory = os.path.join(root, "llama")
    model.save_pretrained(directory)
    return directory, params


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="zocheck-quantized-bench-") as root:
        model, params = build_llama(root, args.hidden, args.layers, args.vocab)
        data = os.path.join(root, "rows.jsonl")
        with open(data, "w") as f:
            f.write("".join(json.dumps({"text": f"row {i} of a small corpus, long enough"}) + "\n" for i in range(8)))
        spec = {"model": model, "data": data, "steps": args.steps, "tokens": args.tokens, "threads": args.threads,
                "device": args.device}
        baseline = _run_child(spec)["baseline_bytes"]
        rows = []
        for name in args.configs:
            r = _run_child({**spec, "config": name})
            train = r["train_peak_bytes"] - baseline
            rows.append({"config": name, **r, "train_extra_bytes": train,
                         "load_extra_bytes": r["load_peak_bytes"] - baseline,
                         "base_bytes": r["linear_bytes"] + r["other_bytes"],
                         "linear_bytes_per_param": r["linear_bytes"] / r["linear_params"],
                         "shadow_over_state": r["shadow_peak_bytes"] / r["state_bytes"],
                         "snapshot_over_state": r["snapshot_bytes"] / r["state_bytes"]})
    targets = [{"target": f"{r['config']}: the shadow's peak at most {SHADOW_BUDGET}x the trained state",
                "measured": f"{r['shadow_over_state']:.3f}x of {r['state_bytes']:,} B",
                "met": r["shadow_over_state"] <= SHADOW_BUDGET} for r in rows]
    return {"benchmark": "quantized", "machine": machine(), "params": params, "hidden": args.hidden,
            "layers": args.layers, "vocab": args.vocab, "baseline_bytes": baseline, "results": rows,
            "targets": targets}


COLUMNS = [("config", "config", "s"), ("train_extra_bytes", "trainer peak B", ",d"),
           ("load_extra_bytes", "load peak B", ",d"), ("base_bytes", "base B", ",d"),
           ("train_rise_bytes", "step rise B", ",d"),
           ("linear_bytes_per_param", "B/linear param", ".4f"), ("state_bytes", "state B", ",d"),
           ("shadow_peak_bytes", "shadow peak B", ",d"), ("shadow_over_state", "peak/state", ".3f"),
           ("snapshot_bytes", "snapshot B", ",d"), ("gpu_train_peak_bytes", "GPU peak B", ",d"), ("exact", "exact", "")]


def run_cli(args) -> int:
    if args.child is not None:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    doc = run(args)
    print(f"Llama {doc['params']:,} parameters (hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}), "
          f"ZO-SGD, {args.steps} steps of {args.tokens} tokens; peaks over a baseline of {doc['baseline_bytes']:,} B")
    return report_exact_targets(doc, COLUMNS, args.json)


def register(bench) -> None:
    b = bench.add_parser("quantized", help="the trainer's and the shadow's memory with quantized bases and QZO")
    add_arguments(b)
    b.set_defaults(func=run_cli)


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--hidden", type=int, default=768)
    b.add_argument("--layers", type=int, default=12)
    b.add_argument("--vocab", type=int, default=32000)
    b.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    b.add_argument("--steps", type=int, default=4)
    b.add_argument("--tokens", type=int, default=32, help="tokens per batch row (default 32)")
    b.add_argument("--threads", type=int, default=2, help="the trainer's intra-op threads (default 2)")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the trainer's device (default cpu)")
    b.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    b.add_argument("--child", help=argparse.SUPPRESS)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantized")
    add_arguments(parser)
    sys.exit(run_cli(parser.parse_args()))
