"""The Triton kernels give the eager oracle's bits: checked on the CPU in Triton's interpreter.

The kernels run on CPU tensors through the interpreter (`triton_kernels` loads an
interpreted copy of the kernel source for them, whatever TRITON_INTERPRET says), so the
code path the trainer takes on CUDA (`ZOOptimizer(backend="triton")`, `replay_triton`)
is exercised here without a GPU. test_cuda.py runs the compiled kernels where CUDA is.
"""

import itertools
import logging
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import (  # noqa: E402
    DTYPES, KINDS, OPTIMIZERS, SEGMENTS, assert_equal_lists, config_for, run_kernels, run_oracle,
)

from zocheck_ray import ZOConfig, ZOOptimizer, state_hash  # noqa: E402
from zocheck_ray.core import update  # noqa: E402
from zocheck_ray.core.gpu import kernel_guard, triton_kernels  # noqa: E402
from zocheck_ray.core.errors import StateMismatchError  # noqa: E402
from zocheck_ray.core.backend import perturbation  # noqa: E402
from zocheck_ray.workload.models import build_model, trainable_parameters  # noqa: E402

pytestmark = pytest.mark.slow  # kernels run by Triton's CPU interpreter


@pytest.mark.parametrize("kind", KINDS)
def test_z_kernel_equals_the_oracle(kind):
    for seed, offset, numel in [(0, 0, 1), (3, 1, 4098), (2**64 - 1, 2**32 - 3, 77), (2**40 + 9, 5 * 2**33 + 2, 1000)]:
        got = perturbation(seed, offset, numel, kind, device="cpu", backend="triton")
        assert got.dtype == torch.float32 and got.shape == (numel,)
        assert torch.equal(got, perturbation(seed, offset, numel, kind, backend="eager")), (seed, offset, numel)


@pytest.mark.parametrize("optimizer,dtype,kind", list(itertools.product(OPTIMIZERS, DTYPES, KINDS)))
def test_kernels_equal_the_oracle(optimizer, dtype, kind):
    """Both ways the kernels run a step (the trainer's four launches, the replay's one) give the
    oracle's parameters and moments after two steps, on odd sizes and offsets beyond 2**32."""
    config = config_for(optimizer, kind)
    want_p, want_m, want_v, records = run_oracle(config, DTYPES[dtype])
    changed = [not torch.equal(p, q) for p, q in zip(want_p, run_kernels(config, DTYPES[dtype], [], "cpu", "x")[0])]
    assert any(changed)  # the steps do something (in bf16 too)
    for path in ("trainer", "replay"):
        got_p, got_m, got_v = run_kernels(config, DTYPES[dtype], records, "cpu", path)
        assert_equal_lists(got_p, want_p, f"{path} params")
        assert_equal_lists(got_m, want_m, f"{path} exp_avg")
        assert_equal_lists(got_v, want_v, f"{path} exp_avg_sq")


@pytest.mark.parametrize("optimizer,dtype", [("zo-sgd", "bf16"), ("zo-adam", "fp32"), ("sparse-mezo", "fp16"),
                                             ("zo-sgd-sign", "bf16"), ("zo-sgd-mmt", "fp16"), ("zo-sgd-cons", "fp32")])
def test_kernels_equal_the_oracle_with_several_perturbations(optimizer, dtype):
    """n-SPSA: q = 3 perturbations per step, each with its own seed, their estimate formed in order."""
    config = config_for(optimizer, "gaussian", q=3)
    want_p, want_m, want_v, records = run_oracle(config, DTYPES[dtype])
    assert all(len(r.grads) == 3 for r in records)
    for path in ("trainer", "replay"):
        got_p, got_m, got_v = run_kernels(config, DTYPES[dtype], records, "cpu", path)
        assert_equal_lists(got_p, want_p, f"{path} params")
        assert_equal_lists(got_m, want_m, f"{path} buffers")
        assert_equal_lists(got_v, want_v, f"{path} second buffers")


def test_weight_decay_zero_takes_the_undecayed_sequence():
    config = config_for("zo-sgd", "gaussian", weight_decay=0.0)
    want_p, _, _, records = run_oracle(config, torch.bfloat16)
    assert_equal_lists(run_kernels(config, torch.bfloat16, records, "cpu", "trainer")[0], want_p, "params")


CASES = [("zo-sgd", "bf16", "gaussian", 5), ("zo-adam", "fp32", "gaussian", 5),
         ("sparse-mezo", "fp16", "rademacher", 5), ("zo-sgd-cons", "bf16", "gaussian", 4)]
"""(optimizer, dtype, perturbation, steps). ZO-SGD-Sign and -MMT take the same launches as ZO-SGD and
ZO-Adam here (their trainer path is checked against the oracle in every dtype above); ZO-SGD-Cons adds
its moves and the decisions of a real model's losses (three forward passes a step: four steps)."""


@pytest.mark.parametrize("optimizer,dtype,kind,steps", CASES)
def test_trainer_cuda_path_equals_the_cpu_trainer(optimizer, dtype, kind, steps):
    """The trainer's kernel path (the one it takes on CUDA), driven on CPU tensors, takes the
    CPU trainer's steps bit for bit on a Hugging Face OPT, and its records replay exactly with
    `replay_triton` (test_core_exactness checks the fused CPU replay against the same trainer)."""
    config = ZOConfig(optimizer=optimizer, lr=1e-3, eps=1e-2, weight_decay=0.05, perturbation=kind)
    eager_model, kernel_model = build_model("tiny-opt", dtype), build_model("tiny-opt", dtype)
    eager = ZOOptimizer(trainable_parameters(eager_model), config, backend="eager")
    kernels = ZOOptimizer(trainable_parameters(kernel_model), config, backend="triton")
    assert eager.kernel_backend == "eager" and kernels.kernel_backend == "triton"
    assert kernels.kernel_check.passed and kernels.kernel_check.checks > 0
    initial = {k: v.clone() for k, v in kernels.state_tensors().items()}
    gen = torch.Generator().manual_seed(0)
    records = []
    for t in range(steps):
        ids = torch.randint(0, 128, (2, 12), generator=gen)
        record = eager.step(lambda: eager_model(input_ids=ids, labels=ids).loss, seed=1000 + t)
        assert kernels.step(lambda: kernel_model(input_ids=ids, labels=ids).loss, seed=1000 + t) == record
        records.append(record)
    trained = kernels.state_tensors()
    assert state_hash(trained) == state_hash(eager.state_tensors())
    assert not torch.equal(trained["model.decoder.embed_tokens.weight"], initial["model.decoder.embed_tokens.weight"])
    replayed = triton_kernels.replay_triton({k: v.clone() for k, v in initial.items()}, records, config, start_step=0)
    assert state_hash(replayed) == state_hash(trained)


def test_replay_on_device_uses_the_backend_it_is_given():
    config = ZOConfig(lr=1e-2, eps=1e-2)
    model = build_model("tiny-opt", "bf16")
    opt = ZOOptimizer(trainable_parameters(model), config, backend="eager")
    initial = {k: v.clone() for k, v in opt.state_tensors().items()}
    ids = torch.arange(24).view(2, 12)
    records = [opt.step(lambda: model(input_ids=ids, labels=ids).loss, seed=s) for s in range(2)]
    for backend in ("triton", "eager"):
        state = triton_kernels.replay_on_device({k: v.clone() for k, v in initial.items()}, records, config,
                                                start_step=0, backend=backend)
        assert state_hash(state) == state_hash(opt.state_tensors()), backend


def _flip_low_bit(phase, tensors):
    for t in tensors:
        if t is not None and t.numel():
            t.view(-1)[:1].view(torch.uint8)[0] ^= 1


def test_the_guard_catches_a_wrong_kernel_and_the_trainer_falls_back(caplog):
    config = ZOConfig(lr=1e-2, eps=1e-2, weight_decay=0.1)
    model = build_model("tiny-opt", "fp32")
    with kernel_guard.inject_fault_for_tests(_flip_low_bit), caplog.at_level(logging.ERROR):
        opt = ZOOptimizer(trainable_parameters(model), config, backend="triton")
        check = opt.kernel_check
        assert opt.kernel_backend == "eager"
        assert check.passed is False and check.backend == "eager" and check.mismatches
        assert "falls back to the eager path" in caplog.text
        reference = build_model("tiny-opt", "fp32")
        eager = ZOOptimizer(trainable_parameters(reference), config, backend="eager")
        ids = torch.arange(24).view(2, 12)
        for t in range(2):  # the fallback trains exactly (no kernel runs, so the fault cannot touch it)
            record = opt.step(lambda: model(input_ids=ids, labels=ids).loss, seed=t)
            assert eager.step(lambda: reference(input_ids=ids, labels=ids).loss, seed=t) == record
        assert state_hash(opt.state_tensors()) == state_hash(eager.state_tensors())
    assert check.as_dict()["passed"] is False
    # without the fault the same check passes (the cache was cleared on leaving the block)
    assert kernel_guard.check_kernels("cpu", (torch.float32,), config).passed is True


def test_sparse_mezo_masks_take_at_most_one_bit_per_element():
    config = ZOConfig(optimizer="sparse-mezo", lr=1e-2, eps=1e-2)
    params = [torch.randn(n) for _, n, _ in SEGMENTS]
    stepper = triton_kernels.KernelStepper([triton_kernels.Segment(*s) for s in SEGMENTS], params, [], [], config)
    (mask,) = [g[-1] for g in stepper.groups]
    numel = sum(p.numel() for p in params)
    assert mask.dtype == torch.uint8 and mask.numel() <= numel // 8 + len(params)
    model = build_model("tiny-opt", "fp32")
    opt = ZOOptimizer(trainable_parameters(model), config, backend="eager")
    seen = []
    original = update.pack_mask
    try:
        update.pack_mask = lambda m: seen.append(original(m)) or seen[-1]
        opt.step(lambda: torch.zeros(()), seed=1)
    finally:
        update.pack_mask = original
    assert seen and all(m.dtype == torch.uint8 for m in seen)
    assert sum(m.numel() for m in seen) <= sum(p.numel() for p in opt.params) // 8 + len(opt.params)


@pytest.mark.parametrize("numel", [1, 8, 13, 4099])
def test_packed_masks_round_trip_on_both_code_paths(numel):
    mask = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < 0.4
    packed = update.pack_mask(mask)
    assert torch.equal(update.pack_mask_torch(mask), packed)
    assert torch.equal(update.unpack_mask(packed, numel), mask)
    assert torch.equal(update.unpack_mask_torch(packed, numel), mask)


def test_a_model_on_two_devices_is_refused_naming_the_parameter():
    named = [("a.weight", torch.zeros(2, 2)), ("b.weight", torch.zeros(2, 2, device="meta"))]
    with pytest.raises(StateMismatchError, match=r"'b\.weight' is on meta but 'a\.weight' is on cpu"):
        ZOOptimizer(named, ZOConfig())


def test_an_unsupported_dtype_is_refused_naming_the_parameter():
    with pytest.raises(StateMismatchError, match=r"'h\.weight' has dtype torch.float64"):
        ZOOptimizer([("h.weight", torch.zeros(2, 2, dtype=torch.float64))], ZOConfig(), backend="triton")


def test_the_kernels_refuse_devices_they_do_not_run_on():
    with pytest.raises(StateMismatchError, match="meta"):
        ZOOptimizer([("w", torch.zeros(4, device="meta"))], ZOConfig(), backend="triton")
    with pytest.raises(ValueError, match="backend"):
        ZOOptimizer([("w", torch.zeros(4))], ZOConfig(), backend="cuda")


def test_the_package_runs_without_triton():
    code = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError
import torch
from zocheck_ray import ZOConfig, ZOOptimizer, perturbation
from zocheck_ray.core.gpu import kernel_guard, triton_kernels
assert not triton_kernels.available()
opt = ZOOptimizer([("w", torch.zeros(8))], ZOConfig())
opt.step(lambda: torch.zeros(()), seed=1)
assert opt.kernel_backend == "eager"
check = kernel_guard.check_kernels("cpu", (torch.float32,), ZOConfig())
assert check.passed is None and check.backend == "eager" and "not installed" in check.reason
try:
    ZOOptimizer([("w", torch.zeros(8))], ZOConfig(), backend="triton")
except RuntimeError as e:
    assert "pip install triton" in str(e)
else:
    raise AssertionError("backend='triton' without triton must fail")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.parametrize("interpret_env", ["1", "0"])
def test_the_compiled_and_interpreted_kernels_do_not_depend_on_triton_interpret(interpret_env):
    # TRITON_INTERPRET=1 is the documented way to run Triton on a CPU: it must not turn the compiled
    # copy (the trainer's on CUDA, and the PTX checks below) into an interpreted one
    code = """
from zocheck_ray.core.gpu import triton_kernels
compiled, interpreted = triton_kernels._source(False).zo_kernel, triton_kernels._source(True).zo_kernel
print(type(compiled).__name__, type(interpreted).__name__)
"""
    env = {**os.environ, "TRITON_INTERPRET": interpret_env}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["JITFunction", "InterpretedFunction"]


COMPILED = [  # (PHASE, OPT, DTYPE, GAUSSIAN, MASK, SEARCH): every phase, optimizer and dtype once
    (0, 0, 0, True, 0, 0), (1, 2, 2, True, 1, 0), (2, 1, 0, False, 0, 1), (3, 0, 1, True, 0, 2),
    (3, 1, 2, True, 0, 3), (2, 2, 1, False, 2, 1),
]


@pytest.mark.parametrize("phase,opt,dtype,gaussian,mask,search", COMPILED)
def test_the_compiled_kernel_rounds_every_operation_on_its_own(phase, opt, dtype, gaussian, mask, search):
    """Compiled for Hopper (sm_90, no GPU needed): no FMA, IEEE division and square root, no
    flush-to-zero; with fp fusion on, the Gaussian transform does contract (so the check can fail)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = triton_kernels._source(False).zo_kernel
    types = ["*i64"] * 6 + ["*i32", "*fp32", "*i32", "i32", "i32", "*u8", "*fp32", "i64", "i64"] + ["fp32"] * 12
    signature = dict(zip(kernel.arg_names, types))
    constexprs = dict(PHASE=phase, OPT=opt, DTYPE=dtype, GAUSSIAN=gaussian, MASK=mask, B4=256, SEARCH=search)
    signature.update({name: "constexpr" for name in constexprs})

    def ptx(fusion):
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, enable_fp_fusion=fusion)).asm["ptx"]

    code = ptx(triton_kernels.ENABLE_FP_FUSION)
    assert not re.search(r"\b(?:fma|mad)(?:\.\w+)*\.f(?:16|32|64)\b", code)  # (integer mad.wide is fine)
    assert not re.search(r"\.ftz\b|\.approx\b|div\.full", code)
    assert re.search(r"\badd\.rn\.f32", code) and not re.search(r"\badd\.f32", code)
    if gaussian or opt == 1:
        assert "div.rn.f32" in code
    if opt == 1 and phase in (2, 3):
        assert "sqrt.rn.f32" in code
    if gaussian:  # the polynomials are multiply-add chains
        assert re.search(r"\bfma\.rn\.f32", ptx(True))


def test_extra_search_steps_find_the_same_tensors():
    """On CUDA a plan takes at least SEARCH_STEPS_CUDA binary-search steps (so the guard compiled the
    variant the model uses); more steps than a plan needs must change nothing."""
    segments = [triton_kernels.Segment(*s) for s in SEGMENTS]
    results = []
    for extra in (0, 3):
        plan = triton_kernels.Plan(segments, torch.device("cpu"), weight_decay=0.1)
        plan.search += extra
        params = [torch.zeros(n) for _, n, _ in SEGMENTS]
        plan.launch(triton_kernels.PHASE_PERTURB, seed=5, optimizer="zo-sgd", dtype=torch.float32, gaussian=True,
                    params=params, c_a=1.0)
        results.append(params)
    for got, want, (offset, n, _) in zip(results[1], results[0], SEGMENTS):
        assert torch.equal(got, want)
        assert torch.equal(want, perturbation(5, offset, n, backend="eager"))
