"""ZO-Bench's and MeZO's update rules, written out again in plain torch, equal `ZOOptimizer` bit for bit.

Each rule follows its reference's code (ZO-Bench: zo-bench/trainer.py `zo_step`, `zo_step_v1`, `zo_conserv_step`
and torch's SGD with momentum; MeZO: large_models/trainer.py `zo_update`), with the project's two documented
differences: z from the device-invariant generator, and g and the scalars in float64 cast once to float32. Every
product and sum is its own rounded operation, as the project's operation sequence spells it (docs/fidelity.md).
"""

import pytest
import torch

from zocheck_ray import ZOConfig, ZOOptimizer
from zocheck_ray.core.generator import perturbation
from zocheck_ray.core.layout import applies_weight_decay
from zocheck_ray.core.seeds import perturbation_seeds

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NAMES = ("fc.weight", "fc.bias", "layer_norm.weight", "model.norm.weight")
SHAPES = ((6, 5), (6,), (6,), (6,))


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).to(torch.float32))


def make_params(dtype):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in SHAPES]


def loss_of(params) -> float:
    """A smooth loss of every tensor (float64 from float32 values, as a task's loss reaches the optimizer)."""
    w, b, ln, norm = (p.float() for p in params)
    x = torch.linspace(-1, 1, 5)
    h = torch.tanh(w @ x + b) * ln + norm
    return float((h * h).sum())


def zs(seed, params):
    """z of every tensor at its global offset, rounded to the tensor's dtype (kept in float32)."""
    out, offset = [], 0
    for p in params:
        out.append(perturbation(seed, offset, p.numel()).view(p.shape).to(p.dtype).float())
        offset += p.numel()
    return out


def r(x, dtype):
    return x.to(dtype).float()


def perturb(params, z, c):
    """ZO-Bench's zo_perturb_parameters: param = param + scaling_factor * z * eps."""
    for i, p in enumerate(params):
        params[i] = r(p.float() + r(z[i] * c, p.dtype), p.dtype).to(p.dtype)


def projected_grads(params, seeds, eps):
    """The q two-point gradients, each with its own z, the parameters back at the start after each."""
    grads = []
    for seed in seeds:
        z = zs(seed, params)
        perturb(params, z, f32(eps))
        loss1 = loss_of(params)
        perturb(params, z, f32(-2 * eps))
        loss2 = loss_of(params)
        perturb(params, z, f32(eps))
        grads.append((loss1 - loss2) / (2 * eps))
    return grads


def direction(params, seeds, coefficients):
    """sum_j coefficient_j * z_j in float32 (ZO-Bench's param.grad of zo_step_v1), per tensor."""
    out = []
    for i in range(len(params)):
        acc = None
        for seed, c in zip(seeds, coefficients):
            term = zs(seed, params)[i] * f32(c)
            acc = term if acc is None else acc + term
        out.append(acc)
    return out


def sgd_move(params, grad, lr, wd=0.0):
    """torch SGD's p -= lr * grad, MeZO's decay term added first on its tensors."""
    for i, (name, p) in enumerate(zip(NAMES, params)):
        u = r(grad[i], p.dtype)
        if wd and applies_weight_decay(name, tuple(p.shape)):
            u = r(u + r(p.float() * f32(wd), p.dtype), p.dtype)
        params[i] = r(p.float() - r(u * f32(lr), p.dtype), p.dtype).to(p.dtype)


def reference_step(rule, params, seed, q, lr, eps, momentum=None, mu=0.9, wd=0.0):
    seeds = perturbation_seeds(seed, q)
    if rule == "zo-sgd-cons":
        loss0 = loss_of(params)
    grads = projected_grads(params, seeds, eps)
    if rule == "zo-sgd-sign":  # zo_sign_opt: np.sign(projected_grad) * z / q
        coefficients = [float((g > 0) - (g < 0)) / q for g in grads]
    else:
        coefficients = [g / q for g in grads]
    grad = direction(params, seeds, coefficients)
    if rule == "zo-sgd-mmt":  # torch SGD, momentum mu, dampening 0: buf = buf * mu + grad; p -= lr * buf
        for i, p in enumerate(params):
            momentum[i] = momentum[i] * f32(mu) + grad[i]
            params[i] = r(p.float() - r(momentum[i] * f32(lr), p.dtype), p.dtype).to(p.dtype)
        return
    if rule != "zo-sgd-cons":
        sgd_move(params, grad, lr, wd)
        return
    sgd_move(params, grad, lr)  # zo_conserv_step: the descent step, then the ascent step, then the best of three
    loss1 = loss_of(params)
    sgd_move(params, grad, -2 * lr)
    loss2 = loss_of(params)
    if loss1 > loss0:
        if loss0 < loss2:
            sgd_move(params, grad, lr)
    elif loss1 < loss2:
        sgd_move(params, grad, 2 * lr)


def ours(rule, dtype, q, steps, lr, eps, wd=0.0):
    params = [p.clone() for p in make_params(dtype)]
    opt = ZOOptimizer(list(zip(NAMES, params)), ZOConfig(optimizer=rule, lr=lr, eps=eps, num_perturbations=q,
                                                         weight_decay=wd), backend="eager")
    for t in range(steps):
        opt.step(lambda: loss_of(params), seed=100 + t)
    return params


def theirs(rule, dtype, q, steps, lr, eps, wd=0.0):
    params = make_params(dtype)
    momentum = [torch.zeros(p.shape) for p in params]
    for t in range(steps):
        reference_step(rule, params, 100 + t, q, lr, eps, momentum, wd=wd)
    return params


@pytest.mark.parametrize("rule,dtype", [("zo-sgd", "fp32"), ("zo-sgd", "bf16"), ("zo-sgd-sign", "fp32"),
                                        ("zo-sgd-sign", "bf16"), ("zo-sgd-mmt", "fp32"), ("zo-sgd-cons", "fp32")])
@pytest.mark.parametrize("q", [1, 2])
def test_zo_bench_rules_in_plain_torch_equal_zo_optimizer(rule, dtype, q):
    lr, eps = (0.05, 1e-3) if dtype == "fp32" else (0.05, 1e-2)
    got = ours(rule, DTYPES[dtype], q, 4, lr, eps)
    want = theirs(rule, DTYPES[dtype], q, 4, lr, eps)
    for name, a, b in zip(NAMES, got, want):
        assert torch.equal(a, b), f"{rule} {dtype} q={q}: {name} differs"


def test_zo_sgd_sign_steps_along_sign_of_g_times_z_not_the_elementwise_sign():
    """ZO-Bench's rule moves each element by lr * |z|; ZO-signSGD (`zo-signsgd`) by lr * sign(g z)."""
    lr, eps = 0.25, 1e-3
    start = make_params(torch.float32)
    back = [p.clone() for p in start]  # after +eps, -2 eps, +eps: not quite the start (rounding)
    g = projected_grads(back, (100,), eps)[0]
    z = zs(100, start)
    sign_g = float((g > 0) - (g < 0))
    assert sign_g != 0
    bench = ours("zo-sgd-sign", torch.float32, 1, 1, lr, eps)
    elementwise = ours("zo-signsgd", torch.float32, 1, 1, lr, eps)
    for i, p in enumerate(back):
        assert torch.equal(bench[i], p - (z[i] * sign_g) * lr)
        assert torch.equal(elementwise[i], p - torch.sign(z[i] * g) * lr)
        assert not torch.equal(bench[i], elementwise[i])


def test_mezo_weight_decay_rule_decays_every_name_without_bias_or_layer_norm():
    assert applies_weight_decay("model.norm.weight", (6,))  # Llama's final norm: MeZO decays it
    assert applies_weight_decay("model.layers.0.self_attn.q_norm.weight", (8,))
    assert not applies_weight_decay("model.layers.0.input_layernorm.weight", (8,))
    assert not applies_weight_decay("model.decoder.final_layer_norm.weight", (8,))
    assert not applies_weight_decay("model.decoder.layers.0.fc1.bias", (8,))
    assert applies_weight_decay("model.decoder.embed_tokens.weight", (8, 4))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_mezo_zo_update_with_weight_decay_in_plain_torch_equals_zo_optimizer(dtype):
    """MeZO's zo_update: p -= lr * (g z + wd p) on its tensors, p -= lr * g z on the others."""
    eps = 1e-3 if dtype == "fp32" else 1e-2
    got = ours("zo-sgd", DTYPES[dtype], 1, 3, 0.05, eps, wd=0.5)
    want = theirs("zo-sgd", DTYPES[dtype], 1, 3, 0.05, eps, wd=0.5)
    for name, a, b in zip(NAMES, got, want):
        assert torch.equal(a, b), f"{name} differs"
