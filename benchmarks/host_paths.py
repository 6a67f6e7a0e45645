"""`python -m benchmarks host-paths`: each Linux speed-up of `host/` against its plain path, side by side.

    python -m benchmarks host-paths --size-mib 512 --rounds 3 --json benchmarks/results/host-paths.json

The plain path is what `ZOCHECK_HOST_PLAIN=1` selects (and what a host without the capability gets):
- image read / intake write: a trainer on the shadow's node reads the image by opening its memfd,
  against windows through Ray (`image_window`, `write_intake`), by the product's own link code;
- frozen heap: an actor-like start-up (import torch and transformers, build an OPT model) with the
  collector paused and the survivors frozen, against the plain heap, and a full collection afterwards;
- direct I/O: a snapshot-sized local file written with O_DIRECT against buffered writes, with the page
  cache each leaves behind;
- thread niceness: a trainer-like loop's step beside a process replaying without pause, its replay
  thread at `shadow.nice` (19) against the niceness it started with (Ray starts workers at 15).
Each figure is the best of its rounds; the variants alternate within a round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common import machine, print_table, write_json

MiB = 1 << 20


def _plain(on: bool) -> None:
    from zocheck_ray.host import capabilities

    if on:
        os.environ[capabilities.PLAIN_ENV] = "1"
    else:
        os.environ.pop(capabilities.PLAIN_ENV, None)
    capabilities.capabilities.cache_clear()


def _state(nbytes: int) -> dict[str, torch.Tensor]:
    rows = max(1, nbytes // (4 * 4096 * 16))
    gen = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(rows, 4096, generator=gen) for i in range(16)}


# ------------------------------------------------------------------ image hand-over through the link


def _owner_class():
    import ray

    @ray.remote(num_cpus=0)
    class Owner:
        """The shadow's side of a hand-over, served as `ShadowActor` serves it."""

        def __init__(self, names, dtypes, shapes):
            from zocheck_ray.host.image import ImageLayout, image_memory

            self.layout = ImageLayout.from_specs(list(zip(names, dtypes, shapes)))
            self.buffer = image_memory(self.layout.nbytes)
            self.buffer.bytes.copy_(torch.randint(0, 256, (self.layout.nbytes,), dtype=torch.uint8))
            self.node = ray.get_runtime_context().get_node_id()

        def offer_image(self, fresh=False, held=None):
            from zocheck_ray.host.handle import ImageHandle
            from zocheck_ray.runtime.messages import RecoveryOffer

            handle = ImageHandle.of(self.buffer, self.layout, token="t", step=1, node_id=self.node)
            return RecoveryOffer(image=handle, records=b"", source="memory", adapter=None)

        def image_window(self, token, start, length):
            return self.buffer.bytes[start: start + length].numpy().copy()

        def give_back(self, token):
            pass

        def open_intake(self, names, dtypes, shapes):
            from zocheck_ray.host.handle import ImageHandle

            return ImageHandle.of(self.buffer, self.layout, token="intake", step=None, node_id=self.node)

        def write_intake(self, start, data):
            from zocheck_ray.host.memory import frombuffer

            self.buffer.bytes[start: start + len(data)].copy_(frombuffer(data))

        def shared(self) -> bool:
            return self.buffer.shared

    return Owner


def image_rows(nbytes: int, rounds: int) -> list[dict]:
    import ray

    from zocheck_ray.actors.link import OfferedImage, RayShadowLink
    from zocheck_ray.actors.names import NAMESPACE, shadow_name
    from zocheck_ray.host.image import ImageLayout, transfer_threads

    state = _state(nbytes)
    layout = ImageLayout.of(state)
    Owner = _owner_class()
    owners = {}
    for plain in (False, True):
        env = {"env_vars": {"ZOCHECK_HOST_PLAIN": "1"}} if plain else {}
        owners[plain] = Owner.options(name=shadow_name(f"bench-{int(plain)}"), namespace=NAMESPACE,
                                      runtime_env=env).remote(layout.names, layout.dtypes, layout.shapes)
        assert ray.get(owners[plain].shared.remote()) is not plain
    best: dict[tuple[str, bool], float] = {}
    threads = transfer_threads()
    out = {name: torch.empty_like(t) for name, t in state.items()}
    for _ in range(rounds):
        for plain, owner in owners.items():
            began = time.perf_counter()
            offer = OfferedImage(owner, ray.get(owner.offer_image.remote()), local=True, threads=threads)
            offer.copy_into(out)
            offer.release()
            read = time.perf_counter() - began
            assert offer.through == ("ray" if plain else "memfd")
            link = RayShadowLink(f"bench-{int(plain)}", threads=threads)
            began = time.perf_counter()
            link.write_state(state)
            write = time.perf_counter() - began
            for key, seconds in (("read", read), ("write", write)):
                best[key, plain] = min(best.get((key, plain), float("inf")), seconds)
    for owner in owners.values():
        ray.kill(owner)
    rows = []
    for key, what in (("read", "image read (a restore's copy)"), ("write", "intake write (a resync's copy)")):
        fast, slow = best[key, False], best[key, True]
        rows.append({"speed_up": what, "fast": "memfd", "plain": "windows through Ray", "fast_s": fast,
                     "plain_s": slow, "gain": slow / fast})
    return rows


# ------------------------------------------------------------------ the frozen heap

_STARTUP = r"""
import gc, json, time
began = time.perf_counter()
from zocheck_ray.host.heap import settling_heap
with settling_heap():
    import torch, transformers
    from transformers import OPTConfig, OPTForCausalLM
    model = OPTForCausalLM(OPTConfig(hidden_size=512, ffn_dim=2048, num_hidden_layers=8, num_attention_heads=8,
                                     vocab_size=8192))
startup = time.perf_counter() - began
began = time.perf_counter()
gc.collect()
print(json.dumps({"startup": startup, "collect": time.perf_counter() - began}))
"""


def heap_rows(rounds: int) -> list[dict]:
    best: dict[tuple[str, bool], float] = {}
    for _ in range(rounds):
        for plain in (False, True):
            env = {**os.environ, "ZOCHECK_HOST_PLAIN": "1"} if plain else \
                {k: v for k, v in os.environ.items() if k != "ZOCHECK_HOST_PLAIN"}
            out = subprocess.run([sys.executable, "-c", _STARTUP], env=env, check=True, capture_output=True,
                                 text=True).stdout
            figures = json.loads(out.strip().splitlines()[-1])
            for key, seconds in figures.items():
                best[key, plain] = min(best.get((key, plain), float("inf")), seconds)
    return [{"speed_up": what, "fast": "paused, frozen", "plain": "plain heap", "fast_s": best[key, False],
             "plain_s": best[key, True], "gain": best[key, True] / best[key, False]}
            for key, what in (("startup", "actor-like start-up"), ("collect", "a full collection after it"))]


# ------------------------------------------------------------------ direct I/O


def _cached_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def direct_io_rows(nbytes: int, rounds: int, directory: str) -> list[dict]:
    from zocheck_ray.host.localfile import open_local_write

    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()
    chunk = 8 * MiB
    best: dict[tuple[str, bool], float] = {}
    for _ in range(rounds):
        for plain in (False, True):
            _plain(plain)
            path = os.path.join(directory, f"snapshot-{int(plain)}.bin")
            cached = _cached_bytes()
            began = time.perf_counter()
            f = open_local_write(path)
            for a in range(0, nbytes, chunk):
                f.write(memoryview(data[a: a + chunk]))
            f.flush()
            os.fsync(f.fileno())
            f.close()
            seconds = time.perf_counter() - began
            grown = max(0, _cached_bytes() - cached)
            os.unlink(path)
            best["write", plain] = min(best.get(("write", plain), float("inf")), seconds)
            best["cache", plain] = min(best.get(("cache", plain), float("inf")), grown / MiB)
    _plain(False)
    return [{"speed_up": "snapshot file write + fsync", "fast": "O_DIRECT", "plain": "buffered",
             "fast_s": best["write", False], "plain_s": best["write", True],
             "gain": best["write", True] / best["write", False]},
            {"speed_up": "page cache left behind (MiB)", "fast": "O_DIRECT", "plain": "buffered",
             "fast_s": best["cache", False], "plain_s": best["cache", True],
             "gain": best["cache", True] / max(best["cache", False], 1.0)}]


_REPLAYER = r"""
import sys, threading
import torch
from benchmarks.replay import make_records, make_state
from zocheck_ray.core import ZOConfig, replay
from zocheck_ray.host.priority import background_thread

def loop():
    background_thread("zocheck-replay", 19)  # the plain path leaves the niceness as it is
    config = ZOConfig(optimizer="zo-sgd", lr=1e-6, eps=1e-3)
    state = make_state(int(sys.argv[1]), torch.float32, "zo-sgd")
    records = make_records(state, config, 1000)
    print("ready", flush=True)
    for r in records:
        replay(state, [r], config, start_step=r.step, threads=2)

threading.Thread(target=loop, daemon=True).start()
sys.stdin.read()
"""


def nice_rows(rounds: int, params: int, steps: int = 20) -> list[dict]:
    """Run last: this process takes Ray's worker niceness (15), which the replaying child inherits."""
    os.setpriority(os.PRIO_PROCESS, 0, max(15, os.getpriority(os.PRIO_PROCESS, 0)))
    torch.manual_seed(0)
    a, b = torch.randn(768, 768), torch.randn(768, 768)

    def trainer_step() -> float:
        began = time.perf_counter()
        for _ in range(40):
            torch.mm(a, b)
        return time.perf_counter() - began

    alone = min(trainer_step() for _ in range(steps))
    best: dict[bool, float] = {}
    for _ in range(rounds):
        for plain in (False, True):
            env = {**os.environ, "ZOCHECK_HOST_PLAIN": "1"} if plain else \
                {k: v for k, v in os.environ.items() if k != "ZOCHECK_HOST_PLAIN"}
            child = subprocess.Popen([sys.executable, "-c", _REPLAYER, str(params)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            try:
                assert child.stdout.readline().strip() == "ready"
                time.sleep(1.0)  # the replay's kernels compiled and running
                seconds = sorted(trainer_step() for _ in range(steps))[steps // 2]  # the median step
            finally:
                child.kill()
                child.wait()
            best[plain] = min(best.get(plain, float("inf")), seconds)
    return [{"speed_up": "trainer step beside the replay", "fast": "replay at nice 19", "plain": "replay at nice 15",
             "fast_s": best[False], "plain_s": best[True], "gain": best[True] / best[False], "alone_s": alone}]


def run(args: argparse.Namespace) -> int:
    import ray

    nbytes = args.size_mib * MiB
    rows = []
    print(f"host paths: {args.size_mib} MiB state, best of {args.rounds} rounds", flush=True)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    try:
        rows += image_rows(nbytes, args.rounds)
    finally:
        ray.shutdown()
    rows += heap_rows(args.rounds)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        rows += direct_io_rows(nbytes, args.rounds, directory)
    rows += nice_rows(args.rounds, nbytes // 4)
    print_table(rows, [("speed_up", "speed-up", "s"), ("fast", "fast path", "s"), ("plain", "plain path", "s"),
                       ("fast_s", "fast (s)", ".3f"), ("plain_s", "plain (s)", ".3f"), ("gain", "plain/fast", ".2f"),
                       ("alone_s", "alone (s)", ".3f")])
    write_json(args.json, {"benchmark": "host-paths", "machine": machine(), "size_mib": args.size_mib,
                           "rounds": args.rounds, "rows": rows})
    return 0


def register(bench) -> None:
    parser = bench.add_parser("host-paths", help="each Linux speed-up of host/ against its plain path",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=512, help="the state's size (default 512 MiB)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; figures are the best (default 3)")
    parser.add_argument("--dir", default=None, help="where the direct-I/O files go (default: the temp directory)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.set_defaults(func=run)
