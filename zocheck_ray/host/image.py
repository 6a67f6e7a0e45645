"""State images: a state as one flat buffer, kept in memory that the shadow owns.

An image is one aligned buffer (`ImageLayout`), so it is one object to copy, hand over and
persist. Where the host offers it (`capabilities.shared_images`), an
image is a memfd, freed when its last holder closes it, not an object in Ray's store, which frees
asynchronously and would break the shadow's budget of two copies of the state. A trainer on the same
node reads it through `/proc/<pid>/fd/<n>` a window at a time; elsewhere the image is private memory
and the reader gets the same windows through Ray (`actors/link.py`).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Literal, Mapping

import torch

from zocheck_ray.host.capabilities import capabilities
from zocheck_ray.host.handle import ImageHandle
from zocheck_ray.core.dtypes import BY_NAME, REPLAYED
from zocheck_ray.core.cpus import process_cpus
from zocheck_ray.host.memory import aligned_offsets, anonymous_mapping, frombuffer

logger = logging.getLogger(__name__)

WINDOW_BYTES = 64 << 20
"""What a transfer copies per call (and maps, into a CUDA trainer's staging)."""
TRANSFER_THREADS_MAX = 8
"""A copy at memory bandwidth gains nothing from more threads."""


def transfer_threads() -> int:
    """Threads for a restore or an intake: the process's CPUs, up to `TRANSFER_THREADS_MAX`."""
    return min(TRANSFER_THREADS_MAX, process_cpus())


@dataclass(frozen=True)
class ImageLayout:
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor]) -> "ImageLayout":
        return cls.from_specs([(n, REPLAYED[t.dtype], tuple(t.shape)) for n, t in state.items()])

    @classmethod
    def from_specs(cls, specs: list[tuple[str, str, tuple[int, ...]]]) -> "ImageLayout":
        """From (name, dtype name, shape) in canonical order."""
        offsets, total = aligned_offsets(_numel(shape) * _itemsize(dtype) for _, dtype, shape in specs)
        return cls(tuple(n for n, _, _ in specs), tuple(d for _, d, _ in specs),
                   tuple(tuple(s) for _, _, s in specs), tuple(offsets), total)

    @property
    def state_bytes(self) -> int:
        """The tensors' own bytes (without alignment padding)."""
        return sum(_numel(s) * _itemsize(d) for d, s in zip(self.dtypes, self.shapes))

    def spans(self) -> Iterator[tuple[str, int, int]]:
        """(name, offset, bytes) of each tensor, in order."""
        for name, dtype, shape, offset in zip(self.names, self.dtypes, self.shapes, self.offsets):
            yield name, offset, _numel(shape) * _itemsize(dtype)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensors over the uint8 buffer `flat` (no copy), in canonical order."""
        out = {}
        for name, dtype, shape, offset in zip(self.names, self.dtypes, self.shapes, self.offsets):
            size = _numel(shape) * _itemsize(dtype)
            out[name] = flat[offset: offset + size].view(BY_NAME[dtype]).view(shape)
        return out

    def matches(self, state: Mapping[str, torch.Tensor]) -> str | None:
        """None when `state` has this layout's names, order, dtypes and shapes, else what differs."""
        if tuple(state) != self.names:
            missing = sorted(set(self.names) - set(state))[:3]
            extra = sorted(set(state) - set(self.names))[:3]
            return f"the tensors differ (missing {missing}, unexpected {extra})" if missing or extra else \
                "the tensors are in another order"
        for (name, t), dtype, shape in zip(state.items(), self.dtypes, self.shapes):
            if REPLAYED.get(t.dtype) != dtype or tuple(t.shape) != shape:
                return f"{name} is {t.dtype} {tuple(t.shape)} here and {dtype} {shape} in the image"
        return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=BY_NAME[dtype]).element_size()


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (no copy; any device)."""
    if not t.is_contiguous():
        raise ValueError("an image holds contiguous tensors only")
    return t.detach().reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------------------------------- memory


def anonymous_buffer(nbytes: int) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A private uint8 buffer of `nbytes`, faulted now; returns the tensor and the
    mapping that owns its memory."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8), None
    flat, region = anonymous_mapping(nbytes)
    flat.zero_()  # fault every page now, not inside the first copy into it
    return flat, region


class SharedBuffer:
    """A memfd of `nbytes`, allocated up front so a lack of memory fails here, not with SIGBUS in a copy; its
    unique name tells a reader it opened this buffer, not a reused descriptor."""

    shared = True

    def __init__(self, nbytes: int, name: str = "zocheck-image"):
        self.nbytes = nbytes
        self.name = f"{name}-{secrets.token_hex(8)}"
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            if nbytes:
                os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as exc:
            os.close(self.fd)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise MemoryError(f"cannot allocate an image of {nbytes / 1e9:.2f} GB of shared memory on this "
                                  f"node: {exc.strerror}") from exc
            raise
        self._map = mmap.mmap(self.fd, nbytes) if nbytes else None
        self.bytes = frombuffer(self._map) if nbytes else torch.empty(0, dtype=torch.uint8)
        """The whole buffer as a uint8 tensor (its views must go before `close`)."""

    @property
    def path(self) -> str:
        """Where another process on this node opens it."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def close(self) -> None:
        if self.fd < 0:
            return
        self.bytes = None
        _unmap(self._map)
        self._map = None
        os.close(self.fd)
        self.fd = -1


class PrivateBuffer:
    """The plain path: an image in this process's own memory, faulted up front, which readers get through Ray."""

    shared = False
    name = None

    def __init__(self, nbytes: int, name: str = "zocheck-image"):
        self.nbytes = nbytes
        try:
            self.bytes, self._map = anonymous_buffer(nbytes)
        except (OSError, RuntimeError) as exc:
            raise MemoryError(f"cannot allocate an image of {nbytes / 1e9:.2f} GB on this node: {exc}") from exc
        self.fd = -1
        """No descriptor: readers go through Ray."""
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.bytes = None
        _unmap(self._map)
        self._map = None


def _unmap(region: mmap.mmap | None) -> None:
    if region is not None:
        try:
            region.close()
        except BufferError:  # a view is still referenced (an exception's frame): unmapped with the last one
            pass


ImageBuffer = SharedBuffer | PrivateBuffer


def image_memory(nbytes: int, name: str = "zocheck-image") -> ImageBuffer:
    """Memory for an image: a memfd where the host offers them, else private memory."""
    return SharedBuffer(nbytes, name) if capabilities().shared_images else PrivateBuffer(nbytes, name)


# ---------------------------------------------------------------------------------------- hand-over


def handle_layout(handle: ImageHandle) -> ImageLayout:
    """The layout of the image `handle` reaches."""
    return ImageLayout.from_specs(list(zip(handle.names, handle.dtypes, handle.shapes)))


class ImageGoneError(RuntimeError):
    """The image's owner replaced it or died before it was opened: ask again."""


def open_image(handle: ImageHandle, write: bool = False) -> int | None:
    """Open the owner's memfd on this node; None where it cannot be opened here, so the reader goes through Ray."""
    if handle.memfd is None:
        return None
    try:
        fd = os.open(handle.path, os.O_RDWR if write else os.O_RDONLY)
    except OSError as exc:
        logger.info("cannot open the image at %s (%s): reading it through Ray", handle.path, exc.strerror)
        return None
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        opened = ""
    if not opened.startswith(f"/memfd:{handle.memfd} ") or os.fstat(fd).st_size != handle_layout(handle).nbytes:
        os.close(fd)  # another process's descriptor with the same number
        logger.info("%s is not the shadow's image %s: reading it through Ray", handle.path, handle.memfd)
        return None
    return fd


Direction = Literal["from_image", "to_image"]


def transfer(fd: int, layout: ImageLayout, tensors: Mapping[str, torch.Tensor], direction: Direction,
             threads: int = 1, window: int = WINDOW_BYTES, staged: bool | None = None) -> None:
    """Copy between the image in `fd` and `tensors`, a window at a time: host tensors by `preadv`/`pwritev`, CUDA
    tensors through two pinned staging buffers, each upload overlapping the next window's staging."""
    plan = WindowPlan(layout, tensors, window, staged)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if direction == "to_image" else 0)

    def one(start: int) -> None:
        if plan.direct:
            plan.copy_direct(fd, start, direction)
            return
        region = mmap.mmap(fd, plan.length(start), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=prot,
                           offset=start)
        try:
            plan.copy(frombuffer(region), start, direction)
        finally:
            region.close()

    if threads <= 1 or len(plan.starts) <= 1 or plan.staging is not None:
        for start in plan.starts:
            one(start)
    else:
        with ThreadPoolExecutor(min(threads, len(plan.starts)), thread_name_prefix="zocheck-transfer") as pool:
            list(pool.map(one, plan.starts))
    plan.finish()


class WindowPlan:
    """Which bytes of which tensor each window of an image holds."""

    def __init__(self, layout: ImageLayout, tensors: Mapping[str, torch.Tensor], window: int = WINDOW_BYTES,
                 staged: bool | None = None):
        problem = layout.matches(tensors)
        if problem is not None:
            raise ValueError(f"the state does not fit the image: {problem}")
        granule = mmap.ALLOCATIONGRANULARITY
        self.window = max(granule, window // granule * granule)  # mapped windows start on a page
        self.nbytes = layout.nbytes
        self.starts = list(range(0, layout.nbytes, self.window))
        self.targets = {name: byte_view(t) for name, t in tensors.items()}
        cuda = any(t.is_cuda for t in self.targets.values())
        self.staging = _Staging(self.window, pinned=cuda) if (cuda if staged is None else staged) else None
        self.direct = not cuda and self.staging is None
        """Host tensors, unstaged: `copy_direct` moves their bytes with `preadv`/`pwritev`."""
        self.pieces: dict[int, list[tuple[str, int, int, int]]] = {s: [] for s in self.starts}
        for name, offset, size in layout.spans():  # (name, where in the window, first, end byte of the tensor)
            a, end = 0, size
            while a < end:
                start = (offset + a) // self.window * self.window
                b = min(end, start + self.window - offset)
                self.pieces[start].append((name, offset + a - start, a, b))
                a = b

    def length(self, start: int) -> int:
        return min(self.window, self.nbytes - start)

    def copy(self, win: torch.Tensor, start: int, direction: Direction) -> None:
        """Copy window `start` (`win`) into the tensors, or the tensors into it."""
        for name, at, a, b in self.pieces[start]:
            target, source = self.targets[name][a:b], win[at: at + b - a]
            if direction == "to_image":
                source.copy_(target)  # from a CUDA tensor: a synchronous device-to-host copy
            elif self.staging is not None:
                self.staging.upload(source, target)
            else:
                target.copy_(source)

    def copy_direct(self, fd: int, start: int, direction: Direction) -> None:
        """Window `start` between `fd` and host tensors by `preadv`/`pwritev`: one copy, no mapping (mapping costs
        more)."""
        for name, at, a, b in self.pieces[start]:
            view = memoryview(self.targets[name][a:b].numpy())
            offset, done = start + at, 0
            while done < len(view):
                if direction == "from_image":
                    n = os.preadv(fd, [view[done:]], offset + done)
                else:
                    n = os.pwritev(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise ImageGoneError(f"the image ended at byte {offset + done} of {self.nbytes}")
                done += n

    def finish(self) -> None:
        """Wait for the copies in flight."""
        if self.staging is not None:
            self.staging.finish()


class _Staging:
    """Two host buffers of a window each (pinned, on CUDA): one uploads while the other is filled."""

    def __init__(self, window: int, pinned: bool):
        self.buffers = [torch.empty(window, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        self.cuda = pinned
        self.events: list = [None, None]
        self.turn = 0
        self.used = 0
        self.switches = 0

    def upload(self, source: torch.Tensor, target: torch.Tensor) -> None:
        n = source.numel()
        if self.used + n > self.buffers[self.turn].numel():
            self._switch()
        staged = self.buffers[self.turn][self.used: self.used + n]
        staged.copy_(source)
        target.copy_(staged, non_blocking=True)  # on the CPU: a plain copy, done when it returns
        self.used += n

    def _switch(self) -> None:
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            self.events[self.turn] = event
        self.turn, self.used = 1 - self.turn, 0
        self.switches += 1
        if self.events[self.turn] is not None:
            self.events[self.turn].synchronize()  # the buffer about to be refilled has reached the device

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().synchronize()
        self.events = [None, None]


# ---------------------------------------------------------------------------------------- skeleton

def prepare_skeleton(tensors: Mapping[str, torch.Tensor]) -> None:
    """Fault a skeleton's pages now (zeroed), so that a later restore is a plain copy."""
    for t in tensors.values():
        t.detach().zero_()


# ---------------------------------------------------------------------------------------- in-process


def copy_state(dst: Mapping[str, torch.Tensor], src: Mapping[str, torch.Tensor], threads: int = 1) -> None:
    """`dst[k].copy_(src[k])` for every tensor, split so that `threads` threads share the work."""
    jobs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, target in dst.items():
        t, s = byte_view(target), byte_view(src[name])
        for a in range(0, t.numel(), WINDOW_BYTES):
            jobs.append((t[a: a + WINDOW_BYTES], s[a: a + WINDOW_BYTES]))
    if threads <= 1 or len(jobs) <= 1:
        for t, s in jobs:
            t.copy_(s)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="zocheck-copy") as pool:
        list(pool.map(lambda job: job[0].copy_(job[1]), jobs))
