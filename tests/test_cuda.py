"""CPU vs CUDA bit-exactness; runs wherever CUDA is present and skips elsewhere."""

import pytest
import torch

from zocheck_ray import ZOConfig, ZOOptimizer, perturbation, replay, replay_reference, state_hash
from zocheck_ray.workload.models import build_model, trainable_parameters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("kind", ["gaussian", "rademacher"])
def test_generator_is_identical_on_cpu_and_cuda(kind):
    for seed, offset, numel in [(1, 0, 1_000_003), (2**64 - 1, 2**33 + 3, 77_777)]:
        cpu = perturbation(seed, offset, numel, kind)
        gpu = perturbation(seed, offset, numel, kind, device="cuda").cpu()
        assert torch.equal(cpu, gpu)


@pytest.mark.parametrize("optimizer", ["zo-sgd", "zo-adam", "sparse-mezo"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_cuda_trainer_is_replayed_exactly_on_the_cpu(optimizer, dtype):
    config = ZOConfig(optimizer=optimizer, lr=1e-3, eps=1e-2, weight_decay=0.05)
    model = build_model("tiny-opt", dtype, device="cuda")
    opt = ZOOptimizer(trainable_parameters(model), config)
    initial = {k: v.detach().cpu().clone() for k, v in opt.state_tensors().items()}
    gen = torch.Generator().manual_seed(0)
    records = []
    for t in range(10):
        ids = torch.randint(0, 128, (2, 12), generator=gen).cuda()
        records.append(opt.step(lambda: model(input_ids=ids, labels=ids).loss, seed=t))
    trained = {k: v.detach().cpu() for k, v in opt.state_tensors().items()}
    fused = replay({k: v.clone() for k, v in initial.items()}, records, config)
    reference = replay_reference({k: v.clone() for k, v in initial.items()}, records, config)
    on_gpu = replay_reference({k: v.clone().cuda() for k, v in initial.items()}, records, config)
    for name in trained:
        assert torch.equal(fused[name], trained[name]), name
        assert torch.equal(reference[name], trained[name]), name
        assert torch.equal(on_gpu[name].cpu(), trained[name]), name
    assert state_hash(fused) == state_hash(trained)
