"""`python -m benchmarks restore`: the two ways an image reaches a recovering trainer, against a plain copy.

    python -m benchmarks restore --gib 1 --rounds 5 --json restore.json

Two processes on this machine, as in a recovery on the CPU: an owner holds the image in shared
memory (`actors.image.SharedBuffer`, as the shadow does), and a receiver holds a model-shaped
skeleton (`workload.weights.materialize`: one mapping advised onto 2 MiB pages, faulted in advance
as a waiting trainer's is, `actors.image.prepare_skeleton`). In interleaved rounds (a loaded
machine slows every contender alike), each on all the CPUs of this process (up to 8):

- **write**: the owner writes the image into the receiver's memory (`actors.image.push_image`,
  `process_vm_writev`): what the shadow does where the host lets it;
- **read**: the receiver reads the image out of the owner's memfd (`actors.image.transfer`, `preadv`):
  what the trainer does where the host forbids the write;
- **copy** (the baseline): the receiver copies the same bytes from memory of its own into the same
  skeleton (`torch.Tensor.copy_`, the same windows and threads).

Each path's figure is its best round, and so is the copy's; `fraction` is a path's GB/s over the copy's.
The receiver checks every byte after every round (`exact`). The target (issue: restores at >= 50% of a
plain copy) is met when the path the product takes on this host (`write` where the kernel allows it,
else `read`) reaches half of the copy.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time

import torch

from benchmarks.common import machine, md_table, print_table, write_json
from zocheck_ray.actors.image import (ImageLayout, PushRefused, SharedBuffer, allow_writer, copy_state,
                                      prepare_skeleton, push_image, segments_of, transfer, transfer_threads)
from zocheck_ray.workload.weights import materialize

TARGET = 0.5
"""A restore at half a plain copy's bandwidth or better."""


def _state_specs(nbytes: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """A model-shaped fp32 state of about `nbytes`: an embedding of a quarter, the rest in 16 MiB matrices."""
    embed = nbytes // 4 // 4096 * 4096
    specs = [("embed", "float32", (embed // 4 // 1024, 1024))]
    left, i = nbytes - embed, 0
    while left >= 16 << 20:
        specs.append((f"layer{i}", "float32", (2048, 2048)))
        left, i = left - (16 << 20), i + 1
    if left >= 4:
        specs.append(("tail", "float32", (left // 4,)))
    return specs


def _filled(layout: ImageLayout, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in zip(layout.names, layout.shapes)}


def _owner(specs, threads: int, conn) -> None:
    """The shadow's side: the image in a memfd; writes it into the receiver when asked."""
    layout = ImageLayout.from_specs(specs)
    buffer = SharedBuffer(layout.nbytes)
    copy_state(layout.views(buffer.bytes), _filled(layout, seed=1), threads=threads)
    conn.send((os.getpid(), buffer.fd))
    while True:
        message = conn.recv()
        if message is None:
            break
        pid, segments = message
        began = time.perf_counter()
        try:
            push_image(buffer.bytes, pid, segments, threads=threads)
        except PushRefused as exc:
            conn.send(str(exc))
            continue
        conn.send(time.perf_counter() - began)
    buffer.close()


class _Skeleton(torch.nn.Module):
    def __init__(self, specs):
        super().__init__()
        for name, _, shape in specs:
            self.register_parameter(name, torch.nn.Parameter(torch.empty(shape, device="meta")))


def measure(nbytes: int, rounds: int = 5, say=print) -> dict:
    """The three paths' best GB/s over `rounds` interleaved rounds, and whether every round was exact."""
    specs = _state_specs(nbytes)
    layout = ImageLayout.from_specs(specs)
    threads = transfer_threads()
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(specs, threads, there), daemon=True)
    owner.start()
    try:
        pid, fd_number = here.recv()
        model = _Skeleton(specs)
        materialize(model, one_mapping=True)
        skeleton = dict(model.named_parameters())
        with torch.no_grad():
            prepare_skeleton(skeleton)
        expected = _filled(layout, seed=1)  # the image's bytes, held here for the copy and the checks
        segments = segments_of(layout, skeleton)
        fd = os.open(f"/proc/{pid}/fd/{fd_number}", os.O_RDONLY)
        allow_writer(pid)  # as a recovering trainer lets the shadow
        seconds: dict[str, list[float]] = {"copy": [], "write": [], "read": []}
        exact, refused = True, None
        for r in range(rounds):
            for path in ("copy", "write", "read"):
                with torch.no_grad():
                    for t in skeleton.values():
                        t.zero_()
                began = time.perf_counter()
                if path == "copy":
                    copy_state(skeleton, expected, threads=threads)
                    took = time.perf_counter() - began
                elif path == "read":
                    transfer(fd, layout, skeleton, "from_image", threads=threads)
                    took = time.perf_counter() - began
                else:
                    here.send((os.getpid(), segments))
                    took = here.recv()  # timed in the owner: the write alone, not the pipe
                    if isinstance(took, str):
                        refused = took
                        continue
                seconds[path].append(took)
                exact = exact and all(torch.equal(skeleton[n], expected[n]) for n in layout.names)
            say(f"  round {r + 1}/{rounds}: " + ", ".join(
                f"{p} {layout.nbytes / s[-1] / 1e9:.1f} GB/s" for p, s in seconds.items() if s))
        os.close(fd)
    finally:
        here.send(None)
        owner.join(timeout=60)
    gbps = {p: layout.nbytes / min(s) / 1e9 if s else None for p, s in seconds.items()}
    taken = "write" if refused is None else "read"
    rows = [{"path": p, "gbps": gbps[p], "fraction": gbps[p] / gbps["copy"] if gbps[p] else None,
             "rounds_gbps": [layout.nbytes / s / 1e9 for s in seconds[p]]} for p in ("copy", "write", "read")]
    return {"bytes": layout.nbytes, "tensors": len(specs), "threads": threads, "rounds": rounds, "rows": rows,
            "exact": exact, "write_refused": refused, "product_path": taken,
            "target": {"restore_at_least_half_a_copy": (gbps[taken] or 0) >= TARGET * gbps["copy"]},
            "machine": machine()}


COLUMNS = [("path", "path", "s"), ("gbps", "GB/s", ".1f"), ("fraction", "of the copy", ".2f")]


def markdown(doc: dict) -> str:
    lines = [f"Restore paths: {doc['bytes'] / 1e9:.2f} GB in {doc['tensors']} tensors, {doc['threads']} threads, "
             f"best of {doc['rounds']} interleaved rounds; exact: {doc['exact']}; the product's path here: "
             f"{doc['product_path']}\n", md_table(doc["rows"], COLUMNS)]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    doc = measure(int(args.gib * (1 << 30)), rounds=args.rounds)
    print_table(doc["rows"], COLUMNS)
    if doc["write_refused"]:
        print(f"the owner's writes were refused here ({doc['write_refused']}): the product reads the image")
    met = doc["target"]["restore_at_least_half_a_copy"]
    print(f"target restore ({doc['product_path']}) >= {TARGET:.0%} of a plain copy: {'met' if met else 'not met'}; "
          f"exact: {doc['exact']}")
    write_json(args.json, doc)
    return 0 if doc["exact"] else 1


def register(bench) -> None:
    parser = bench.add_parser("restore", help="an image into a recovering trainer: the shadow's write and the "
                                              "trainer's read vs a plain copy",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="the state's size in GiB (default 1)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; figures are the best (default 5)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.set_defaults(func=run)
