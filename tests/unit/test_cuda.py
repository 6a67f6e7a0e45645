"""CPU vs CUDA bit-exactness; runs wherever CUDA is present and skips elsewhere.

The fused Triton kernels (compiled here; test_triton_kernels.py checks them in the
interpreter) must give the CPU oracle's bits, the trainer must take them on CUDA once the
start-up guard passes, and its records must replay exactly on the CPU.
"""

import itertools
import logging

import pytest
import torch

from zocheck_ray import ZOConfig, ZOOptimizer, perturbation, replay, replay_reference, state_hash
from zocheck_ray.core.gpu import kernel_guard, triton_kernels
from zocheck_ray.workload.models import build_model, trainable_parameters
from kernel_cases import DTYPES, KINDS, OPTIMIZERS, assert_equal_lists, config_for, run_kernels, run_oracle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_triton = pytest.mark.skipif(not triton_kernels.available(), reason="needs Triton (comes with CUDA torch)")


@pytest.mark.parametrize("kind", ["gaussian", "rademacher"])
def test_generator_is_identical_on_cpu_and_cuda(kind):
    for seed, offset, numel in [(1, 0, 1_000_003), (2**64 - 1, 2**33 + 3, 77_777)]:
        cpu = perturbation(seed, offset, numel, kind)
        gpu = perturbation(seed, offset, numel, kind, device="cuda").cpu()
        assert torch.equal(cpu, gpu)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_cuda_trainer_is_replayed_exactly_on_the_cpu(optimizer, dtype):
    config = ZOConfig(optimizer=optimizer, lr=1e-3, eps=1e-2, weight_decay=0.05)
    model = build_model("tiny-opt", dtype, device="cuda")
    opt = ZOOptimizer(trainable_parameters(model), config)
    if triton_kernels.available():
        assert opt.kernel_backend == "triton", opt.kernel_check
    initial = {k: v.detach().cpu().clone() for k, v in opt.state_tensors().items()}
    gen = torch.Generator().manual_seed(0)
    records = []
    for t in range(10):
        ids = torch.randint(0, 128, (2, 12), generator=gen).cuda()
        records.append(opt.step(lambda: model(input_ids=ids, labels=ids).loss, seed=t))
    trained = {k: v.detach().cpu() for k, v in opt.state_tensors().items()}
    fused = replay({k: v.clone() for k, v in initial.items()}, records, config, start_step=0)
    reference = replay_reference({k: v.clone() for k, v in initial.items()}, records, config, start_step=0)
    on_gpu = replay_reference({k: v.clone().cuda() for k, v in initial.items()}, records, config, start_step=0)
    for name in trained:
        assert torch.equal(fused[name], trained[name]), name
        assert torch.equal(reference[name], trained[name]), name
        assert torch.equal(on_gpu[name].cpu(), trained[name]), name
    assert state_hash(fused) == state_hash(trained)
    if triton_kernels.available():
        kernels = triton_kernels.replay_triton({k: v.clone().cuda() for k, v in initial.items()}, records, config, start_step=0)
        assert state_hash({k: v.cpu() for k, v in kernels.items()}) == state_hash(trained)


@needs_triton
@pytest.mark.parametrize("optimizer,dtype,kind", list(itertools.product(OPTIMIZERS, DTYPES, KINDS)))
def test_compiled_kernels_equal_the_cpu_oracle(optimizer, dtype, kind):
    config = config_for(optimizer, kind)
    want_p, want_m, want_v, records = run_oracle(config, DTYPES[dtype])
    for path in ("trainer", "replay"):
        got_p, got_m, got_v = run_kernels(config, DTYPES[dtype], records, "cuda", path)
        assert_equal_lists(got_p, want_p, f"{path} params")
        assert_equal_lists(got_m, want_m, f"{path} exp_avg")
        assert_equal_lists(got_v, want_v, f"{path} exp_avg_sq")


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_z_kernel_equals_the_cpu_oracle(kind):
    for seed, offset, numel in [(0, 0, 1), (3, 1, 1_000_003), (2**64 - 1, 2**32 - 3, 77_777)]:
        got = perturbation(seed, offset, numel, kind, device="cuda", backend="triton").cpu()
        assert torch.equal(got, perturbation(seed, offset, numel, kind, backend="eager"))


@needs_triton
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_start_up_guard_passes_on_this_gpu(optimizer):
    check = kernel_guard.check_kernels("cuda", tuple(DTYPES.values()), ZOConfig(optimizer=optimizer))
    assert check.passed is True and check.backend == "triton", check.mismatches
    assert check.checks > 0 and check.device.startswith("cuda")


@needs_triton
def test_the_guard_falls_back_on_a_wrong_gpu_kernel(caplog):
    def flip(phase, tensors):
        for t in tensors:
            if t is not None and t.numel():
                t.view(-1)[:1].view(torch.uint8)[0] ^= 1

    model = build_model("tiny-opt", "bf16", device="cuda")
    with kernel_guard.inject_fault_for_tests(flip), caplog.at_level(logging.ERROR):
        opt = ZOOptimizer(trainable_parameters(model), ZOConfig(lr=1e-3, eps=1e-2))
    assert opt.kernel_backend == "eager" and opt.kernel_check.passed is False
    assert "falls back to the eager path" in caplog.text


@pytest.mark.parametrize("window", [4096, 64 << 20])
def test_a_restore_into_cuda_tensors_through_pinned_staging_is_the_image(window):
    import os

    from zocheck_ray.host.handle import ImageHandle
    from zocheck_ray.host.image import ImageLayout, SharedBuffer, copy_state, open_image, transfer

    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(3000, 100, generator=g), "b": torch.randn(4097, generator=g).bfloat16(),
             "c": torch.randn(77, 33, generator=g).half()}
    layout = ImageLayout.of(state)
    buffer = SharedBuffer(layout.nbytes)
    copy_state(layout.views(buffer.bytes), state)
    fd = open_image(ImageHandle.of(buffer, layout, token="t", step=0))
    try:
        out = {k: torch.zeros_like(v, device="cuda") for k, v in state.items()}
        transfer(fd, layout, out, "from_image", window=window)
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        written = SharedBuffer(layout.nbytes)
        wfd = open_image(ImageHandle.of(written, layout, token="w", step=None), write=True)
        transfer(wfd, layout, out, "to_image", window=window)  # a CUDA trainer's state into an intake
        os.close(wfd)
        copy_state(back, layout.views(written.bytes))
        written.close()
    finally:
        os.close(fd)
        buffer.close()
    for name in state:
        assert torch.equal(out[name].cpu(), state[name]) and torch.equal(back[name], state[name]), name
