"""`python -m benchmarks scale`: memory, copy bandwidth and recovery against model size.

    python -m benchmarks scale --json benchmarks/results/scale.json --plot benchmarks/results/scale.png
    python -m benchmarks scale --sizes 14M 125M --dtypes fp32 --json /tmp/scale-small.json

Per model size (an OPT built from its config and saved with `save_pretrained` into a
temporary directory: nothing is downloaded) and dtype, side by side in one run:

- `state_bytes`, and the machine's plain copy bandwidth for that many bytes (`copy_`, the
  best of three, measured once the runs are over): on every core (`copy_gbps`), and on each
  thread count a snapshot or a restore ran on (`copy_gbps_by_threads`), into memory already
  touched (what a snapshot into a reused image and a restore into a waiting process's
  prefaulted skeleton do) and into fresh memory (`fresh_copy_gbps...`, what a snapshot into a
  new image does);
- a run with the warm standby and one software failure: the shadow's peak by its own
  accounting (`peak_held_bytes`) and from /proc (VmHWM), its steady resident memory (the
  median of /proc samples over the run's second half), the trainer's peak (every trainer
  process, the standby's included), each as a multiple of the state over the process's fixed
  baseline: the shadow's own (`ShadowMetrics.baseline_bytes`: its resident memory once its
  constructor had imported, loaded its kernels and opened its storage, before any state
  arrived); the trainer's, a process that imported the same modules and ran a ZO step of the
  dtype on two of the optimizer's 4M-element chunks (its fixed working buffers, about 0.1 GB,
  the same at every model size); the snapshot's GB/s in the run without the standby, the
  default job (the median of the shadow's copies into a reused image,
  `ShadowMetrics.snapshot_seconds_median`; where it took none, its last copy, into memory of
  the kind `snapshot_into` names; `snapshot_with_standby_...`: in the run with it, where a CPU
  standby copies each new image while the trainer trains, a second reader beside the
  snapshot) and the restore's (the image's copy into the state alone, the recovery's `copy`
  phase; the best of the runs' restores, `restore_samples_gbps`), each against the plain copy
  on the same number of threads into memory of the same kind (`snapshot_fraction`,
  `restore_fraction`: what the path's own work costs over the copy it makes; the shadow
  copies on its CPUs, a restoring trainer on every core of its process) and against the copy
  on every core (`..._fraction_all_cores`); the recovery (failure seen -> every rank
  restored, ready for its next step) and its phases;
- the same run without the standby (Ray restarts the trainer's process), which loses its trainer
  twice by default (`RESTART_FAILURES`; `--restarts 1`: once, at the same step as the others);
- the async-checkpoint baseline on the same job: a trainer that checkpoints every
  `--every` steps to local disk, killed at the same step; Ray restarts it, it loads its
  checkpoint and recomputes the steps since;
- every run's final state: equal across the three (the same job), and the shadow's equal
  to the trainer's.

Then projections for the paper's jobs (Qwen3-8B in bf16, OPT-13B in fp16): the shadow's
host memory (two copies of the state plus its baseline), the trainer's on a GPU node (its
pinned staging buffers), and the recovery time at the measured restore bandwidth plus the
fixed part measured here. A table, JSON, and a plot where matplotlib is installed.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

from benchmarks.common import machine, print_table, save_byte_tokenizer, write_json
from zocheck_ray.host.memory import process_memory
from zocheck_ray.core.update import CHUNK_ELEMENTS

SIZES = {  # OPT shapes: (hidden, layers, vocabulary); OPT's tokenizer has 50272 tokens
    "tiny-opt": (32, 2, 128), "14M": (256, 2, 50272), "125M": (768, 12, 50272), "270M": (1024, 17, 50272),
    "540M": (1280, 24, 50272), "1B": (2048, 18, 50272),
}
"""`tiny-opt` is the built-in small model's shape (the demo's), saved as a directory like the others."""
DEFAULT_SIZES = ["tiny-opt", "14M", "125M", "270M", "540M", "1B"]
STEPS, FAIL_AT, SNAPSHOT_INTERVAL, LOG_INTERVAL = 12, 9, 2, 3
RESTART_FAILURES = (5, FAIL_AT)
"""The run without the standby loses its trainer twice: two restores into a restarted process's skeleton (a
copy of a few hundred MB takes tens of milliseconds: one sample is at the mercy of what else the node runs then;
the restore counted is the best of the run's samples, as the plain copy's is the best of three)."""
TASK = {"batch_size": 1, "max_length": 16, "eval_interval": 10**9, "eval_size": 1, "eval_batch_size": 1}
ZO = {"lr": 1e-7}
"""The jobs' optimizer settings. The models are built from configs, not pretrained, and at 1B in bf16 MeZO's
default learning rate (1e-6) diverges: projected gradients of -35, 279, 2187, 21060 in steps 0-3, a non-finite
loss at step 9, with or without a failure; at 1e-7 the same steps' losses stay at 0.62-0.87 (gradients -35, 29,
3.7, -3.9). No operation's cost depends on the learning rate."""
PAPER_JOBS = {"Qwen3-8B (bf16)": (8_190_735_360, 2), "OPT-13B (fp16)": (12_853_473_280, 2)}
"""The paper's jobs: (parameters, bytes per parameter)."""
STAGING_BYTES = 2 * (64 << 20)
"""A CUDA trainer's host memory for a restore: two pinned windows (`host.image._CudaStaging`)."""


# ---------------------------------------------------------------------------------------- pieces


def build_directory(size: str, root: str) -> tuple[str, int]:
    """An OPT of `size` saved with `save_pretrained` under `root`; (its directory, its parameters)."""
    import torch
    import transformers

    hidden, layers, vocab = SIZES[size]
    config = transformers.OPTConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                    ffn_dim=2 * hidden if size == "tiny-opt" else 4 * hidden,
                                    num_attention_heads=4 if size == "tiny-opt" else hidden // 64,
                                    max_position_embeddings=128, word_embed_proj_dim=hidden)
    config.architectures = ["OPTForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.OPTForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    directory = os.path.join(root, f"opt-{size}")
    model.save_pretrained(directory)
    save_byte_tokenizer(directory, vocab)
    del model
    gc.collect()
    return directory, params


def parameters_of(size: str) -> int:
    """An OPT shape's parameter count, from its shape alone (before anything is built)."""
    hidden, layers, vocab = SIZES[size]
    ffn = 2 * hidden if size == "tiny-opt" else 4 * hidden
    per_layer = 4 * (hidden * hidden + hidden) + 2 * hidden * ffn + ffn + hidden + 4 * hidden
    return vocab * hidden + (128 + 2) * hidden + layers * per_layer + 2 * hidden


MEMORY_NEED_X = 6
"""Host memory a size needs, in states: the driver's model while it is saved, the shadow's two copies,
the trainer's and the standby's, and the copy-bandwidth measurement's."""
MEMORY_HEADROOM = 4 << 30
"""Beyond those: the processes' baselines (Ray, the imports) and the page cache the runs write through."""


def available_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes (the machine's free memory, counting reclaimable cache)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def too_big(size: str, dtype: str, available: int) -> str | None:
    """Why this machine cannot run `size` in `dtype` (a sentence), or None when it fits."""
    state = parameters_of(size) * (4 if dtype == "fp32" else 2)
    need = MEMORY_NEED_X * state + MEMORY_HEADROOM
    if need <= available:
        return None
    return (f"needs about {need / 2**30:.1f} GiB ({MEMORY_NEED_X}x its {state / 2**30:.1f} GiB state plus "
            f"{MEMORY_HEADROOM / 2**30:.0f} GiB), {available / 2**30:.1f} GiB available")


def copy_bandwidth(nbytes: int, threads: int | None = None, repeats: int = 3) -> tuple[float, float]:
    """(GB/s into touched memory, GB/s into fresh memory) for a plain `copy_` of `nbytes` in this process, on
    `threads` threads (None: torch's default, every core), the best of `repeats`."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        source = torch.ones(nbytes, dtype=torch.uint8)
        touched = torch.empty(nbytes, dtype=torch.uint8)
        touched.copy_(source)
        best = min(_seconds(lambda: touched.copy_(source)) for _ in range(repeats))
        touched = None  # freed before the fresh copies allocate theirs
        fresh = min(_seconds(lambda: torch.empty(nbytes, dtype=torch.uint8).copy_(source)) for _ in range(repeats))
    finally:
        torch.set_num_threads(previous)
    return nbytes / best / 1e9, nbytes / fresh / 1e9


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class MemorySampler:
    """Samples the /proc memory of registered processes (by role) every `period` seconds until stopped."""

    def __init__(self, period: float = 0.05):
        self.period, self.pids = period, {}
        self.samples: list[tuple[float, str, int, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)

    def watch(self, role: str, pid: int) -> None:
        self.pids[pid] = role

    def start(self) -> "MemorySampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            now = time.perf_counter()
            for pid, role in list(self.pids.items()):
                status = process_memory(pid)
                if status:
                    self.samples.append((now, role, pid, status))

    def peak(self, role: str) -> int:
        return max((s["VmHWM"] for _, r, _, s in self.samples if r == role and "VmHWM" in s), default=0)

    def steady(self, role: str) -> int:
        """Median resident memory over the second half of the role's samples."""
        values = [s.get("VmRSS", 0) for _, r, _, s in self.samples if r == role]
        return int(statistics.median(values[len(values) // 2:])) if values else 0


def _footprints(dtypes: tuple[str, ...]) -> dict[str, int]:
    """The trainer's fixed baseline: what a process that imported its modules holds (`trainer`: idle), and
    after one ZO step of `dtype` on a state of two of the optimizer's chunks (`trainer_<dtype>`: its
    chunk-sized working buffers, the same at every model size), each in a process Ray started, as a trainer's. The
    shadow reads its own (`ShadowMetrics.baseline_bytes`)."""
    import ray

    @ray.remote(num_cpus=0, max_calls=1)  # a fresh worker each: VmHWM is the process's own peak
    def trainer_like(dtype: str | None) -> int:
        import torch

        from zocheck_ray.runtime.trainer import Trainer  # noqa: F401  (the trainer's modules)
        from zocheck_ray.core import ZOConfig, ZOOptimizer
        from zocheck_ray.core.fused import warm_up
        from zocheck_ray.core.update import CHUNK_ELEMENTS
        from zocheck_ray.workload.models import build_model

        torch.set_num_threads(1)  # as the trainer's actor (one CPU)
        warm_up(torch.float32, ZOConfig())
        build_model("tiny-opt")  # transformers' model classes loaded
        if dtype is not None:
            weight = torch.zeros(2 * CHUNK_ELEMENTS, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
            ZOOptimizer([("weight", weight)], ZOConfig()).step(lambda: weight.float().sum(), seed=0)
        return process_memory().get("VmHWM", 0)

    trainer, *steps = ray.get([trainer_like.remote(None), *(trainer_like.remote(d) for d in dtypes)])
    return {"trainer": trainer, **{f"trainer_{d}": v for d, v in zip(dtypes, steps)}}


# ---------------------------------------------------------------------------------------- runs


def _zocheck_run(model: str, dtype: str, storage: str, standby: bool, fail_at: tuple[int, ...] = (FAIL_AT,),
                 next_standby: bool = True) -> dict:
    """One run of the job (`standby`: with it), losing its trainer at `fail_at`; `next_standby=False`: after the
    last failure the run ends without waiting for the restarted process to stand by (it is not sampled)."""
    import ray

    from zocheck_ray.actors.names import actor_status
    from zocheck_ray.actors.link import call_when_alive
    from zocheck_ray.config import JobConfig
    from zocheck_ray.control import RunCallback
    from zocheck_ray.testing import run_with_faults

    job = JobConfig(model=model, dtype=dtype, steps=STEPS, storage=storage,
                    shadow={"snapshot_interval": SNAPSHOT_INTERVAL}, zo=ZO,
                    durability={"durable_interval": 3 * SNAPSHOT_INTERVAL}, log_interval=LOG_INTERVAL,
                    failure={"standby": standby}, run_id=f"scale-{uuid.uuid4().hex[:8]}", task=TASK)
    sampler = MemorySampler().start()
    metrics: list = []

    class Watch(RunCallback):
        recovered = 0

        def _waits(self) -> bool:  # for the standby, the restarted process after the last failure included
            return standby and (next_standby or self.recovered < len(fail_at))

        def _pids(self, run) -> None:
            sampler.watch("shadow", run.shadow.pid())
            for actor, name in zip(run.group.all_actors(), run.group.all_names()):
                if actor is run.group.standby and not self._waits():
                    continue
                status = actor_status(name)
                if status is None or status.state == "ALIVE":  # no state API: the call answers once it is up
                    sampler.watch("trainer", call_when_alive(lambda actor=actor: actor.pid.remote()))

        def on_start(self, run, started):
            self._pids(run)

        def on_segment(self, run, segment):
            metrics.append(segment.metrics)
            if self._waits():  # the failure is to meet a standby that is up (its start is not what is measured)
                while run.group.standby is None:
                    time.sleep(0.05)
                call_when_alive(lambda: run.group.standby.readiness.remote())
            self._pids(run)

        def on_recovery(self, run, recovery):
            self.recovered += 1
            self._pids(run)

    try:
        summary = run_with_faults(job, fail_at=list(fail_at), progress=None, callbacks=[Watch()])
    finally:
        sampler.stop()
    assert len(summary.recoveries) == len(fail_at), summary.recoveries
    recovery = summary.recoveries[-1]  # the failure at FAIL_AT, in every run
    final = summary.metrics
    state = final.state_bytes
    # the median of the shadow's copies into a reused image; where it took none, its last copy (into a new image
    # beside one a borrower held: memory not yet touched, or a reused one)
    median, last = final.snapshot_seconds_median, final.snapshot_seconds
    # no copy where a standby held the offered image: nothing copied there to time
    restores = [(state / r.phases["copy"] / 1e9, r.copy_threads) for r in summary.recoveries if r.phases.get("copy")]
    return {"summary": summary, "recovery": recovery, "sampler": sampler,
            "accounted_peak": max([m.peak_held_bytes for m in metrics] + [final.peak_held_bytes]),
            "snapshot_gbps": state / (median or last) / 1e9 if (median or last) else None,
            "snapshot_fresh": median is None and bool(final.snapshot_into_fresh_memory),
            "snapshot_threads": final.snapshot_threads,
            "restores": restores}


def _baseline_run(model: str, dtype: str, storage: str, every: int) -> dict:
    """The async-checkpoint baseline: checkpoints every `every` steps to local disk, no log; after the failure Ray
    restarts the process, which loads its newest checkpoint and recomputes the steps since."""
    import ray

    from benchmarks.baselines import StrategyActor
    from benchmarks.failures import fail_and_recover
    from zocheck_ray.config import JobConfig

    job = JobConfig(model=model, dtype=dtype, steps=STEPS, storage=storage, run_id=f"scale-async-{uuid.uuid4().hex[:8]}",
                    task=TASK, zo=ZO)
    url = os.path.join(storage, job.run_id)
    no_log = os.path.join(storage, job.run_id + "-no-log")  # nothing is logged: the lost steps are recomputed
    os.makedirs(no_log)
    actor = StrategyActor.options(num_cpus=1, max_restarts=2).remote(job.model_dump(mode="json"), url,
                                                                     f"async:{every}", no_log, False)
    try:
        ray.get(actor.recovery.remote())
        recovered = fail_and_recover(actor, FAIL_AT, "software")
        ray.get(actor.run.remote(STEPS))
        ray.get(actor.close.remote())
        _, final_hash = ray.get(actor.state_hash.remote())
    finally:
        ray.kill(actor, no_restart=True)
    return {"seconds": recovered["seconds"], "constructor_seconds": recovered["constructor_seconds"],
            "restore_seconds": recovered["restore_seconds"], "recompute_seconds": recovered["catch_up_seconds"],
            "checkpoint_step": recovered["checkpoint_step"], "final_state_hash": final_hash}


def measure(size: str, dtype: str, root: str, every: int, footprints: dict[str, int], say=print,
            restarts: int = len(RESTART_FAILURES), next_standby: bool = True) -> dict:
    directory, params = build_directory(size, root)
    storage = os.path.join(root, f"runs-{size}-{dtype}")
    try:
        say(f"  {size} {dtype}: {params:,} parameters: zocheck with the standby ...")
        hot = _zocheck_run(directory, dtype, storage, standby=True, next_standby=next_standby)
        say(f"  {size} {dtype}: zocheck without the standby ...")
        cold = _zocheck_run(directory, dtype, storage, standby=False, fail_at=RESTART_FAILURES[-restarts:])
        say(f"  {size} {dtype}: the async-checkpoint baseline ...")
        base = _baseline_run(directory, dtype, storage, every)
        say(f"  {size} {dtype}: plain copies ...")
        nbytes = params * (4 if dtype == "fp32" else 2)
        ran_on = {run["snapshot_threads"] for run in (hot, cold)} | {t for run in (hot, cold)
                                                                      for _, t in run["restores"]}
        copies = {0: copy_bandwidth(nbytes)}  # 0: every core (torch's default)
        copies.update({t: copy_bandwidth(nbytes, t) for t in sorted(ran_on - {None})})
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(directory, ignore_errors=True)
    return _row(size, dtype, params, copies, hot, cold, base, footprints)


def _row(size, dtype, params, copies, hot, cold, base, footprints) -> dict:
    summary, sampler = hot["summary"], hot["sampler"]
    state = summary.metrics.state_bytes
    hashes = {summary.final_state_hash, summary.shadow_state_hash, cold["summary"].final_state_hash,
              cold["summary"].shadow_state_hash, base["final_state_hash"]}

    working = params >= 2 * CHUNK_ELEMENTS  # a model this small never fills the trainer's chunk buffers

    own = summary.metrics.baseline_bytes  # the shadow's memory before its state arrived, read in its own process

    def trainer_baseline(run: dict) -> int:  # its chunk buffers where filled
        return footprints[f"trainer_{dtype}" if working else "trainer"]

    # the best restore of the run: into the standby (unless it held the offered image already: it copied it in while
    # it waited, `TrainerActor.follow`) and into the processes Ray restarted; all into prefaulted skeletons
    samples = [(gbps, threads, "standby") for gbps, threads in hot["restores"]] + \
        [(gbps, threads, "restart") for gbps, threads in cold["restores"]]
    restore, restore_threads, restored_in = max(samples, default=(None, None, None))
    copy_gbps, fresh_gbps = copies[0]

    def baseline(threads: int | None, fresh: bool = False) -> float | None:  # the plain copy on those threads
        return copies[threads][1 if fresh else 0] if threads else None

    def fraction(gbps: float | None, against: float | None) -> float | None:
        return gbps / against if gbps and against else None

    # the snapshot in the default job (no standby); with the standby on a CPU node it copies each new image into its
    # skeleton while the trainer trains (`TrainerActor.follow`), a second reader of memory beside the snapshot
    snap = cold
    snapshot_copy = baseline(snap["snapshot_threads"], snap["snapshot_fresh"])
    restore_copy = baseline(restore_threads)
    cold_best, cold_threads = max(cold["restores"], default=(None, None))

    def over(value: int, baseline: int) -> float:  # a multiple of the state, over the process's fixed baseline
        return (value - baseline) / state

    return {
        "size": size, "dtype": dtype, "params": params, "state_bytes": state, "state_gb": state / 1e9,
        "copy_gbps": copy_gbps, "fresh_copy_gbps": fresh_gbps,
        "copy_gbps_by_threads": {t: c[0] for t, c in copies.items() if t},
        "fresh_copy_gbps_by_threads": {t: c[1] for t, c in copies.items() if t},
        "shadow_accounted_peak_x": hot["accounted_peak"] / state,
        "shadow_peak_x": over(sampler.peak("shadow"), own), "shadow_steady_x": over(sampler.steady("shadow"), own),
        "shadow_baseline_bytes": own,
        # every trainer process of both runs (the standby's included), each run's over the baseline of processes
        # started as its trainers were
        "trainer_peak_x": max(over(run["sampler"].peak("trainer"), trainer_baseline(run)) for run in (hot, cold)),
        "trainer_peak_x_by_run": {name: over(run["sampler"].peak("trainer"), trainer_baseline(run))
                                  for name, run in (("standby", hot), ("restart", cold))},
        "shadow_peak_bytes": sampler.peak("shadow"), "trainer_peak_bytes": sampler.peak("trainer"),
        "snapshot_gbps": snap["snapshot_gbps"], "restore_gbps": restore,
        "restore_measured_in": restored_in, "restore_samples_gbps": [gbps for gbps, _, _ in samples],
        # each against the plain copy on the same threads into memory of the same kind: touched (an image reused,
        # a prefaulted skeleton), or fresh (a new image)
        "snapshot_into": "fresh" if snap["snapshot_fresh"] else "touched",
        "snapshot_threads": snap["snapshot_threads"], "snapshot_copy_gbps": snapshot_copy,
        "snapshot_fraction": fraction(snap["snapshot_gbps"], snapshot_copy),
        "snapshot_fraction_all_cores": fraction(snap["snapshot_gbps"],
                                                fresh_gbps if snap["snapshot_fresh"] else copy_gbps),
        "snapshot_with_standby_gbps": hot["snapshot_gbps"],
        "snapshot_with_standby_fraction": fraction(hot["snapshot_gbps"],
                                                   baseline(hot["snapshot_threads"], hot["snapshot_fresh"])),
        "restore_threads": restore_threads, "restore_copy_gbps": restore_copy,
        "restore_fraction": fraction(restore, restore_copy), "restore_fraction_all_cores": fraction(restore, copy_gbps),
        "restore_cold_gbps": cold_best, "restore_cold_fraction": fraction(cold_best, baseline(cold_threads)),
        "recovery_standby_seconds": hot["recovery"].seconds, "recovery_standby_phases": hot["recovery"].phases,
        "recovery_standby_replaced_by": hot["recovery"].replaced_by,
        "recovery_standby_preinstalled": hot["recovery"].preinstalled,
        # where each recovery resumed: the image it was offered and the records after it that it replayed (none
        # after a recovery snapshot, `shadow.recovery_snapshot`)
        **{f"recovery_{name}_{key}": getattr(run["recovery"], key)
           for name, run in (("standby", hot), ("restart", cold))
           for key in ("recovered_step", "image_step", "replayed_records")},
        "recovery_restart_seconds": cold["recovery"].seconds, "recovery_restart_phases": cold["recovery"].phases,
        "baseline_seconds": base["seconds"], "baseline": base,
        "speedup_standby": base["seconds"] / hot["recovery"].seconds,
        "speedup_restart": base["seconds"] / cold["recovery"].seconds,
        "exact": len(hashes) == 1,
    }


def projections(rows: list[dict], footprints: dict[str, int]) -> list[dict]:
    """The paper's jobs at this machine's measured restore bandwidth and fixed recovery costs."""
    largest = max(rows, key=lambda r: r["state_bytes"])
    # a GPU standby allocates its device memory only when promoted, so it never holds an image in advance: the
    # projection always pays the copy
    copy_seconds = largest["state_bytes"] / (largest["restore_gbps"] * 1e9)
    copied = 0.0 if largest["recovery_standby_preinstalled"] else copy_seconds
    fixed = largest["recovery_standby_seconds"] - copied
    out = []
    for name, (params, itemsize) in PAPER_JOBS.items():
        state = params * itemsize
        out.append({"job": name, "params": params, "state_bytes": state,
                    "shadow_host_bytes": 2 * state + largest["shadow_baseline_bytes"],
                    "trainer_host_bytes_on_gpu": STAGING_BYTES + footprints["trainer"],
                    "recovery_seconds": max(fixed, 0.0) + state / (largest["restore_gbps"] * 1e9),
                    "basis": f"{largest['size']} {largest['dtype']}: restore {largest['restore_gbps']:.2f} GB/s, "
                             f"fixed {max(fixed, 0.0):.2f} s"})
    return out


# ---------------------------------------------------------------------------------------- the benchmark


def scale_benchmark(sizes: list[str] | None = None, dtypes: tuple[str, ...] = ("fp32", "bf16"), every: int = 4,
                    json_path: str | None = None, plot_path: str | None = None, say=print,
                    restarts: int = len(RESTART_FAILURES), next_standby: bool = True) -> dict:
    """`next_standby=False`: the run with the standby ends after its failure without sampling the next one
    (see `_zocheck_run`)."""
    import ray

    from zocheck_ray.actors.connect import connect_ray

    sizes = sizes or DEFAULT_SIZES
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise ValueError(f"unknown sizes {unknown}; known: {list(SIZES)}")
    if not 1 <= restarts <= len(RESTART_FAILURES):
        raise ValueError(f"restarts must be 1 to {len(RESTART_FAILURES)}, got {restarts!r}")
    if not ray.is_initialized():
        connect_ray("local")
    root = tempfile.mkdtemp(prefix="zocheck-bench-scale-")
    try:
        footprints = _footprints(tuple(dtypes))
        say("process baselines: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in footprints.items()))
        rows, skipped, failed = [], [], []
        for size in sizes:
            for dtype in dtypes:
                reason = too_big(size, dtype, available_memory())
                if reason:
                    say(f"  {size} {dtype}: skipped: {reason}")
                    skipped.append({"size": size, "dtype": dtype, "reason": reason})
                    continue
                try:
                    rows.append(measure(size, dtype, root, every, footprints, say, restarts, next_standby))
                except Exception as exc:  # reported, and the sizes after it still run (an hour's rows are kept)
                    lines = str(exc).strip().splitlines() or [""]  # a Ray task's error ends with its cause's line
                    error = f"{type(exc).__name__}: {lines[-1]}"
                    say(f"  {size} {dtype}: failed: {error}")
                    failed.append({"size": size, "dtype": dtype, "error": error})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not rows:
        raise RuntimeError(f"no size was measured: skipped {skipped}, failed {failed}")
    doc = {"benchmark": "scale", "machine": machine(), "footprints": footprints, "rows": rows, "skipped": skipped,
           "failed": failed, "projections": projections(rows, footprints), "targets": targets(rows, failed)}
    report(doc)
    write_json(json_path, doc)
    if plot_path:
        plot(doc, plot_path, say)
    return doc


def targets(rows: list[dict], failed: list[dict] = ()) -> dict:
    """The targets, checked on the rows (the memory and bandwidth ones from 100M parameters up, where the
    state, not the process's own fixed memory or a call's fixed cost, is what is measured); a size whose runs
    failed is not exact."""
    large = [r for r in rows if r["params"] >= 100_000_000] or rows
    biggest = max(rows, key=lambda r: r["state_bytes"])
    return {
        "shadow_peak_at_most_2.1x": all(r["shadow_peak_x"] <= 2.1 for r in large),
        "trainer_peak_at_most_1.2x": all(r["trainer_peak_x"] <= 1.2 for r in large),
        "snapshot_and_restore_at_least_half_a_copy": all(  # a tiny state's copy times measure calls, not bytes
            (r["snapshot_fraction"] or 0) >= 0.5 and (r["restore_fraction"] or 0) >= 0.5 for r in large),
        "standby_recovery_within_1s_plus_copy": all(
            r["recovery_standby_seconds"] <= 1.0 + r["state_bytes"] / (r["copy_gbps"] * 1e9) for r in rows),
        "5x_faster_than_async_checkpoint_at_largest": biggest["speedup_standby"] >= 5.0,
        "every_run_exact": not failed and all(r["exact"] for r in rows),
    }


def report(doc: dict) -> None:
    print_table(doc["rows"], [
        ("size", "size", ""), ("dtype", "dtype", ""), ("state_gb", "state GB", ".2f"),
        ("shadow_accounted_peak_x", "shadow own x", ".2f"), ("shadow_peak_x", "shadow peak x", ".2f"),
        ("shadow_steady_x", "steady x", ".2f"), ("trainer_peak_x", "trainer x", ".2f"),
        ("copy_gbps", "copy GB/s", ".2f"), ("snapshot_fraction", "snap/copy", ".2f"),
        ("snapshot_fraction_all_cores", "(all cores)", ".2f"),
        ("snapshot_with_standby_fraction", "(standby)", ".2f"), ("restore_fraction", "restore/copy", ".2f"),
        ("restore_fraction_all_cores", "(all cores)", ".2f"), ("recovery_standby_seconds", "standby s", ".2f"),
        ("recovery_standby_preinstalled", "held image", ""),
        ("recovery_restart_seconds", "restart s", ".2f"), ("baseline_seconds", "async ckpt s", ".2f"),
        ("speedup_standby", "speedup", ".1f"), ("exact", "exact", "")])
    for p in doc["projections"]:
        print(f"  projected {p['job']}: shadow host {p['shadow_host_bytes'] / 1e9:.1f} GB, trainer host on a GPU "
              f"{p['trainer_host_bytes_on_gpu'] / 1e9:.2f} GB, recovery {p['recovery_seconds']:.1f} s ({p['basis']})")
    for name, met in doc["targets"].items():
        print(f"  target {name}: {'met' if met else 'NOT MET'}")


def plot(doc: dict, path: str, say=print) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, (memory, recovery) = plt.subplots(1, 2, figsize=(11, 4))
    for dtype in sorted({r["dtype"] for r in doc["rows"]}):
        rows = [r for r in doc["rows"] if r["dtype"] == dtype]
        gb = [r["state_bytes"] / 1e9 for r in rows]
        memory.plot(gb, [r["shadow_peak_x"] for r in rows], "o-", label=f"shadow peak ({dtype})")
        memory.plot(gb, [r["trainer_peak_x"] for r in rows], "s--", label=f"trainer peak ({dtype})")
        recovery.plot(gb, [r["recovery_standby_seconds"] for r in rows], "o-", label=f"standby ({dtype})")
        recovery.plot(gb, [r["recovery_restart_seconds"] for r in rows], "s-", label=f"restart ({dtype})")
        recovery.plot(gb, [r["baseline_seconds"] for r in rows], "^--", label=f"async checkpoint ({dtype})")
    memory.axhline(2.0, color="grey", lw=0.8)
    memory.set(xlabel="state (GB)", ylabel="peak over baseline (x state)", title="host memory")
    recovery.set(xlabel="state (GB)", ylabel="seconds", title="software failure: recovery", yscale="log")
    memory.legend(fontsize=7)
    recovery.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    say(f"wrote {path}")


SUITE_SIZES = {"full": DEFAULT_SIZES, "quick": ["tiny-opt", "14M"]}


def run_in_suite(out: Path, quick: bool) -> dict:
    """`bench all`'s run; the JSON in `out`."""
    return scale_benchmark(SUITE_SIZES["quick" if quick else "full"], json_path=str(out / "scale.json"))


def markdown(doc: dict) -> str:
    lines = ["# Scale\n", "Per model size and dtype, side by side (see `benchmarks/scale.py`): memory as a multiple of "
             "the state over each process's fixed baseline, snapshot and restore bandwidth as a fraction of a plain "
             "copy measured in the same run on the same threads (and on every core), software-failure recovery with "
             "the standby, with Ray's restart of the process, and the async-checkpoint baseline's.\n",
             "| size | dtype | state GB | shadow (own) x | shadow peak x | shadow steady x | trainer peak x | copy GB/s "
             "| snapshot / copy (threads; all cores; with the standby) | restore / copy (threads; all cores; copied by) "
             "| standby s "
             "| standby held the image | restart s | async checkpoint s | speedup | exact |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['size']} | {r['dtype']} | {r['state_gb']:.3f} | {r['shadow_accounted_peak_x']:.2f} | "
                     f"{r['shadow_peak_x']:.2f} | {r['shadow_steady_x']:.2f} | {r['trainer_peak_x']:.2f} | "
                     f"{r['copy_gbps']:.2f} | {_f(r['snapshot_fraction'])} ({r['snapshot_threads']}; "
                     f"{_f(r['snapshot_fraction_all_cores'])}; with the standby "
                     f"{_f(r['snapshot_with_standby_fraction'])}) | {_f(r['restore_fraction'])} ({r['restore_threads']}; "
                     f"{_f(r['restore_fraction_all_cores'])}) | "
                     f"{r['recovery_standby_seconds']:.2f} | {r['recovery_standby_preinstalled']} | "
                     f"{r['recovery_restart_seconds']:.2f} | "
                     f"{r['baseline_seconds']:.2f} | {r['speedup_standby']:.1f} | {r['exact']} |")
    for skip in doc.get("skipped", []):
        lines.append(f"\n{skip['size']} {skip['dtype']} was not run: {skip['reason']}.")
    for failure in doc.get("failed", []):
        lines.append(f"\n{failure['size']} {failure['dtype']} failed: {failure['error']}.")
    lines.append("\nProjections (this machine's restore bandwidth and fixed recovery costs):\n")
    for p in doc["projections"]:
        lines.append(f"- {p['job']}: shadow host memory {p['shadow_host_bytes'] / 1e9:.1f} GB, trainer host memory on "
                     f"a GPU node {p['trainer_host_bytes_on_gpu'] / 1e9:.2f} GB, recovery {p['recovery_seconds']:.1f} s "
                     f"({p['basis']})")
    lines.append("")
    lines.extend(f"- {line}" for line in verdicts(doc))
    return "\n".join(lines) + "\n"


def _f(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot_scale(doc: dict, path: str) -> None:
    plot(doc, path, say=lambda line: None)


FIGURES = [("scale.png", plot_scale)]
"""(file name, plot(doc, path)) of each figure `bench all` draws from this benchmark's document."""


def verdicts(doc: dict) -> list[str]:
    """The summary's lines for this benchmark's targets."""
    return [f"scale {name.replace('_', ' ')}: {'met' if met else 'NOT MET'}" for name, met in doc["targets"].items()]


def register(bench) -> None:
    p = bench.add_parser("scale", help="memory, snapshot/restore bandwidth and recovery against model size",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, choices=list(SIZES))
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--every", type=int, default=4, help="the async-checkpoint baseline's checkpoint interval")
    p.add_argument("--restarts", type=int, default=len(RESTART_FAILURES), choices=range(1, len(RESTART_FAILURES) + 1),
                   help="trainer failures in the run without the standby (restores sampled into a restarted process)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write the figure here (PNG; needs matplotlib)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    doc = scale_benchmark(args.sizes, tuple(args.dtypes), args.every, args.json, args.plot, restarts=args.restarts)
    return 0 if doc["targets"]["every_run_exact"] else 1
