"""State images in shared memory: the layout, the windowed hand-over between processes, and who may write an image.

The hand-over is what a recovering trainer does with the shadow's image: open it through
/proc and copy it window by window, never holding it whole. Everything here is exact
(`torch.equal`) and runs without Ray.
"""

import mmap
import multiprocessing
import os
import threading

import pytest
import torch

from zocheck_ray.host.handle import ImageHandle
from zocheck_ray.host.image import (
    TRANSFER_THREADS_MAX, ImageGoneError, ImageLayout, PrivateBuffer, SharedBuffer, WindowPlan, copy_state,
    handle_layout, image_memory, open_image, prepare_skeleton, transfer, transfer_threads,
)
from zocheck_ray.host import capabilities as host_caps
from zocheck_ray.host.heap import settling_heap
from zocheck_ray.runtime.ledger import NoImageError, RecordLedger
from zocheck_ray.host.memory import process_memory
from zocheck_ray.runtime.replay import Image

PAGE = mmap.ALLOCATIONGRANULARITY


def mixed_state(scale: int = 1) -> dict[str, torch.Tensor]:
    """Tensors of every dtype, sized so that small windows cut through them."""
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(3 * scale, 1000, generator=g),
            "norm": torch.randn(17, generator=g).bfloat16(),
            "proj": torch.randn(5 * scale, 999, generator=g).half(),
            "bias": torch.randn(1, generator=g)}


def zeros_like(state):
    return {k: torch.zeros_like(v) for k, v in state.items()}


def filled_buffer(state) -> tuple[SharedBuffer, ImageLayout]:
    layout = ImageLayout.of(state)
    buffer = SharedBuffer(layout.nbytes)
    copy_state(layout.views(buffer.bytes), state)
    return buffer, layout


def assert_equal(a, b):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_every_tensor_starts_aligned_and_views_cover_exactly_its_bytes():
    state = mixed_state()
    layout = ImageLayout.of(state)
    assert all(offset % 64 == 0 for offset in layout.offsets)
    assert layout.state_bytes == sum(t.numel() * t.element_size() for t in state.values())
    assert layout.nbytes >= layout.state_bytes
    assert layout.matches(state) is None
    assert "proj" in layout.matches({**state, "proj": state["proj"].float()})
    assert "order" in layout.matches(dict(reversed(list(state.items()))))


@pytest.mark.parametrize("window", [PAGE, 3 * PAGE, 1 << 26])
@pytest.mark.parametrize("threads", [1, 2])
def test_an_image_read_through_proc_in_windows_equals_its_state(window, threads):
    state = mixed_state(scale=4)
    buffer, layout = filled_buffer(state)
    handle = ImageHandle.of(buffer, layout, token="t", step=7)
    fd = open_image(handle)
    try:
        out = zeros_like(state)
        transfer(fd, handle_layout(handle), out, "from_image", threads=threads, window=window)
    finally:
        os.close(fd)
        buffer.close()
    assert_equal(out, state)


def test_a_host_restore_and_intake_copy_through_the_kernel_without_mapping_a_window(monkeypatch):
    # preadv/pwritev straight into or out of the tensors: mapping each window (and unmapping it, with a TLB
    # flush on every thread) cost more than the copy, which ran at a third of the machine's copy bandwidth
    state = mixed_state(scale=4)
    buffer, layout = filled_buffer(state)
    intake = SharedBuffer(layout.nbytes)
    fd, wfd = open_image(ImageHandle.of(buffer, layout, token="t", step=0)), None

    def refused(*args, **kwargs):
        raise AssertionError("a host transfer mapped a window")

    try:
        wfd = open_image(ImageHandle.of(intake, layout, token="i", step=None), write=True)
        monkeypatch.setattr(mmap, "mmap", refused)
        out = zeros_like(state)
        transfer(fd, layout, out, "from_image", threads=2, window=PAGE)
        transfer(wfd, layout, out, "to_image", threads=2, window=PAGE)
        monkeypatch.undo()
        written = {k: v.clone() for k, v in layout.views(intake.bytes).items()}
    finally:
        for f in (fd, wfd):
            if f is not None:
                os.close(f)
        buffer.close()
        intake.close()
    assert_equal(out, state)
    assert_equal(written, state)


def test_transfers_use_the_cpus_the_process_may_run_on_up_to_a_cap():
    assert 1 <= transfer_threads() <= TRANSFER_THREADS_MAX
    assert transfer_threads() == min(TRANSFER_THREADS_MAX, len(os.sched_getaffinity(0)))


def test_a_restore_through_the_two_staging_windows_equals_its_state():
    # The CUDA path's staging (pinned there), on the CPU: windows alternate between two buffers, a
    # window's pieces are staged before they are copied, tensors cut by windows land whole.
    state = mixed_state(scale=4)
    buffer, layout = filled_buffer(state)
    fd = open_image(ImageHandle.of(buffer, layout, token="t", step=0))
    try:
        out = zeros_like(state)
        plan = WindowPlan(layout, out, window=PAGE, staged=True)
        assert len(plan.starts) > 2
        for start in plan.starts:
            region = mmap.mmap(fd, plan.length(start), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=start)
            plan.copy(torch.frombuffer(region, dtype=torch.uint8), start, "from_image")
            region.close()  # the window is gone: what was staged from it stays valid
        plan.finish()
        assert plan.staging.switches == len(plan.starts) - 1  # a window per buffer, alternating
        staged = zeros_like(state)
        transfer(fd, layout, staged, "from_image", window=PAGE, staged=True)
    finally:
        os.close(fd)
        buffer.close()
    assert_equal(out, state)
    assert_equal(staged, state)


@pytest.mark.parametrize("window", [PAGE, 1 << 26])
def test_a_state_written_into_an_intake_in_windows_is_the_state(window):
    state = mixed_state(scale=4)
    layout = ImageLayout.of(state)
    buffer = SharedBuffer(layout.nbytes)
    handle = ImageHandle.of(buffer, layout, token="intake", step=None)
    fd = open_image(handle, write=True)
    try:
        transfer(fd, layout, state, "to_image", window=window)
        written = {k: v.clone() for k, v in layout.views(buffer.bytes).items()}
    finally:
        os.close(fd)
        buffer.close()
    assert_equal(written, state)


def test_every_window_piece_covers_each_byte_of_each_tensor_once():
    state = mixed_state(scale=4)
    layout = ImageLayout.of(state)
    plan = WindowPlan(layout, state, window=PAGE)
    covered = {name: [] for name in state}
    for start, pieces in plan.pieces.items():
        for name, at, a, b in pieces:
            assert 0 <= at and at + (b - a) <= plan.length(start)
            covered[name].append((a, b))
    for name, spans in covered.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == state[name].numel() * state[name].element_size()
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:])), name


def test_a_state_of_another_layout_is_refused_by_name():
    state = mixed_state()
    buffer, layout = filled_buffer(state)
    fd = open_image(ImageHandle.of(buffer, layout, token="t", step=0))
    try:
        wrong = {**zeros_like(state), "norm": torch.zeros(18, dtype=torch.bfloat16)}
        with pytest.raises(ValueError, match="norm"):
            transfer(fd, layout, wrong, "from_image")
    finally:
        os.close(fd)
        buffer.close()


def test_an_image_its_owner_closed_cannot_be_opened_and_an_open_one_outlives_its_owner():
    state = mixed_state()
    buffer, layout = filled_buffer(state)
    handle = ImageHandle.of(buffer, layout, token="t", step=3)
    fd = open_image(handle)          # opened before the owner lets go: the pages stay
    buffer.close()
    assert open_image(handle) is None  # opened after: not here, the reader asks Ray for the windows
    try:
        out = zeros_like(state)
        transfer(fd, layout, out, "from_image")
    finally:
        os.close(fd)
    assert_equal(out, state)


def test_a_reused_descriptor_number_is_never_read_as_the_image():
    state = mixed_state()
    first, layout = filled_buffer(state)
    handle = ImageHandle.of(first, layout, token="t", step=3)
    first.close()
    second, _ = filled_buffer(state)  # same size, most likely the same descriptor number
    try:
        assert open_image(handle) is None  # its memfd's name is another: never taken for the first
        assert open_image(ImageHandle.of(second, layout, token="u", step=3)) is not None
    finally:
        second.close()


@pytest.fixture
def plain_host(monkeypatch):
    """Every capability probed absent, as `ZOCHECK_HOST_PLAIN=1` makes it in an actor."""
    monkeypatch.setenv(host_caps.PLAIN_ENV, "1")
    host_caps.capabilities.cache_clear()
    yield host_caps.capabilities()
    monkeypatch.delenv(host_caps.PLAIN_ENV)
    host_caps.capabilities.cache_clear()


def test_this_host_offers_every_speed_up_the_plain_paths_stand_in_for():
    caps = host_caps.capabilities()  # the machine the tests run on: otherwise the fast paths go untested
    assert caps.as_dict() == {"shared_images": True, "thread_nice": True, "heap_freeze": True,
                              "direct_io": True}


def test_on_a_plain_host_an_image_is_private_memory_read_through_its_windows(plain_host):
    assert not any(plain_host.as_dict().values())
    state = mixed_state()
    layout = ImageLayout.of(state)
    buffer = image_memory(layout.nbytes)
    assert isinstance(buffer, PrivateBuffer) and buffer.fd == -1
    copy_state(layout.views(buffer.bytes), state)
    handle = ImageHandle.of(buffer, layout, token="t", step=0)
    assert handle.memfd is None and open_image(handle) is None
    out = zeros_like(state)
    plan = WindowPlan(layout, out, window=PAGE)
    for start in plan.starts:  # what `image_window` hands a reader, a window at a time
        plan.copy(buffer.bytes[start: start + plan.length(start)].clone(), start, "from_image")
    assert_equal(out, state)
    buffer.close()
    assert buffer.closed


def test_an_actors_start_up_objects_are_frozen_out_of_the_collectors_reach():
    import gc

    frozen = gc.get_freeze_count()
    with settling_heap():
        assert not gc.isenabled()
        kept = [[] for _ in range(1000)]
    assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(kept)
    gc.unfreeze()


def test_on_a_plain_host_the_heap_is_not_frozen(plain_host):
    import gc

    frozen = gc.get_freeze_count()
    with settling_heap():
        kept = [object() for _ in range(1000)]
    assert gc.get_freeze_count() == frozen and kept


def _own_an_image(nbytes, ready, done):
    buffer = SharedBuffer(nbytes)
    buffer.bytes.fill_(7)
    ready.put((os.getpid(), buffer.fd, buffer.name))
    done.wait()
    buffer.close()


def test_a_reader_in_another_process_never_holds_more_than_a_window_of_the_image():
    nbytes, window = 256 << 20, 16 << 20
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Event()
    owner = ctx.Process(target=_own_an_image, args=(nbytes, ready, done))
    owner.start()
    try:
        pid, fd_number, name = ready.get(timeout=120)
        layout = ImageLayout.from_specs([("w", "float32", (nbytes // 4,))])
        handle = ImageHandle(pid=pid, fd=fd_number, memfd=name, node_id=None, token="t", step=0, names=layout.names,
                             dtypes=layout.dtypes, shapes=layout.shapes)
        out = {"w": torch.zeros(nbytes // 4)}  # faulted in now: the copy adds only mapped windows
        before = process_memory()["VmHWM"]
        fd = open_image(handle)
        try:
            transfer(fd, layout, out, "from_image", window=window)
        finally:
            os.close(fd)
        grown = process_memory()["VmHWM"] - before
    finally:
        done.set()
        owner.join(timeout=60)
    assert torch.equal(out["w"].view(torch.uint8)[:4096], torch.full((4096,), 7, dtype=torch.uint8))
    assert grown <= 2 * window, f"the reader's peak grew by {grown / 2**20:.0f} MiB for a {nbytes >> 20} MiB image"


def test_a_skeleton_is_faulted_now_and_zeroed():
    big = torch.empty(3 * (2 << 20) + 12345, dtype=torch.uint8).fill_(9)
    small = torch.empty(1000, dtype=torch.float32).fill_(9)
    prepare_skeleton({"big": big, "small": small})
    assert not big.any() and not small.any()


# ---------------------------------------------------------------------------------------- who writes


def image_at(step: int, state=None) -> Image:
    state = state or mixed_state()
    buffer, layout = filled_buffer(state)
    return Image(step, buffer, layout, token=f"img-{step}")


def test_an_image_nobody_reads_is_reused_and_a_pinned_one_defers_the_snapshot():
    ledger = RecordLedger(0)
    assert ledger.claim() == ("new", None)
    first = image_at(0)
    ledger.publish(first)
    pinned = ledger.pin(skip_step=None)
    assert pinned is first and ledger.pin(skip_step=0) is None  # persisted already: nothing to pin
    assert ledger.claim() == ("busy", first)                    # persistence reads it: the snapshot waits
    assert ledger.image is first
    ledger.unpin(first)
    assert ledger.claim() == ("reuse", first) and ledger.image is None
    first.buffer.close()


def test_a_borrowed_image_defers_a_snapshot_while_it_is_read_and_is_never_rewritten_until_it_is_given_back():
    ledger = RecordLedger(0)
    ledger.claim()
    image = image_at(0)
    ledger.publish(image)
    lent, records = ledger.recovery_view(lend=True)
    assert lent is image and records == []
    assert ledger.give_back("another-token") is False
    assert ledger.claim() == ("busy", image)  # read now: a snapshot waits for its next boundary
    assert ledger.claim(wait=True) == ("replace", image)  # one that cannot wait: new memory, never this one
    ledger.publish(image)
    image.read_until = 0.0  # a borrower that has not given it back for READ_SECONDS (died reading it)
    assert ledger.claim() == ("replace", image)  # still borrowed: never written again
    ledger.publish(image)
    ledger.recovery_view(lend=True)
    assert ledger.give_back(image.token) is True
    assert ledger.give_back(image.token) is True and image.lent == 0
    assert ledger.claim() == ("reuse", image)
    image.buffer.close()


def test_a_recovery_waits_for_the_image_being_written_and_gets_the_new_one():
    ledger = RecordLedger(0)
    ledger.claim()
    ledger.publish(image_at(0))
    kind, old = ledger.claim()
    assert kind == "reuse"
    got = []
    reader = threading.Thread(target=lambda: got.append(ledger.recovery_view(lend=True)))
    reader.start()
    reader.join(timeout=0.2)
    assert reader.is_alive() and not got  # no image is offered while its memory is written
    new = Image(4, old.buffer, old.layout, token="img-4")
    ledger.publish(new)
    reader.join(timeout=60)
    assert got and got[0][0] is new and new.lent == 1
    new.buffer.close()


def test_a_standby_waiting_for_a_newer_image_wakes_when_one_is_published_and_not_for_the_one_it_holds():
    ledger = RecordLedger(0)
    assert ledger.wait_newer(None, timeout=0) is None  # nothing offered yet
    ledger.claim()
    first = image_at(0)
    ledger.publish(first)
    assert ledger.wait_newer(None, timeout=0) == 0 and ledger.wait_newer("img-0", timeout=0) is None
    got = []
    waiter = threading.Thread(target=lambda: got.append(ledger.wait_newer("img-0", timeout=60)))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not got  # the image it holds is still the newest
    assert ledger.claim() == ("reuse", first)
    ledger.publish(Image(6, first.buffer, first.layout, token="img-6"))
    waiter.join(timeout=60)
    assert got == [6]
    first.buffer.close()


def test_an_initialized_shadow_without_an_image_says_why_instead_of_offering_a_fresh_start():
    ledger = RecordLedger(0)
    assert ledger.recovery_view() == (None, [])  # never initialized: a fresh run
    ledger.claim()
    ledger.unclaim(missing="the snapshot of step 8 could not be taken: out of memory")
    with pytest.raises(NoImageError, match="out of memory"):
        ledger.recovery_view()
