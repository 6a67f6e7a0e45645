"""Backend selection: which implementation computes z and the steps on a device.

Every implementation gives the oracle's bits; "auto" takes the GPU kernels on CUDA once they
pass the start-up guard, eager torch elsewhere. The core's layers, each importing only from those
before it: specification (config, errors, layout, record, scalars, seeds, hashing, cpus) <-
reference (generator, update, reference, validation) <- kernels <- guard <- backend and optimizer.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from zocheck_ray.core import generator
from zocheck_ray.core.gpu import kernel_guard, triton_kernels
from zocheck_ray.core.config import ZOConfig
from zocheck_ray.core.gpu.kernel_guard import KernelCheck
from zocheck_ray.core.layout import Layout
from zocheck_ray.core.gpu.triton_kernels import KernelStepper, Segment

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "eager", "triton")


def perturbation(seed: int, offset: int, numel: int, kind: str = "gaussian", device="cpu",
                 backend: str = "auto") -> torch.Tensor:
    """z (float32, 1-D) for `numel` elements starting at global offset `offset`, from `backend`'s implementation.

    >>> z = perturbation(seed=7, offset=0, numel=10)
    >>> torch.equal(z[4:], perturbation(seed=7, offset=4, numel=6))
    True"""
    if kind not in ("gaussian", "rademacher"):
        raise ValueError(f"unknown perturbation kind {kind!r}; expected 'gaussian' or 'rademacher'")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'eager' or 'triton'")
    device = torch.device(device)
    if backend == "auto" and device.type == "cuda":
        usable = kernel_guard.kernels_usable(device, (torch.float32,), ZOConfig(perturbation=kind))
        backend = "triton" if usable else "eager"
    if backend == "triton":
        return triton_kernels.perturbation_triton(seed, offset, numel, kind, device)
    return generator.perturbation(seed, offset, numel, kind, device)


def kernel_stepper(layout: Layout, params: Sequence[torch.Tensor], exp_avg: Sequence[torch.Tensor],
                   exp_avg_sq: Sequence[torch.Tensor], config: ZOConfig, backend: str
                   ) -> tuple[KernelStepper | None, KernelCheck | None]:
    """The kernels' stepper for a trainer's tensors and the guard's verdict: (None, None) where `backend` does
    not ask for the kernels, (None, check) where they failed the guard."""
    device = params[0].device
    if not (backend == "triton" or (backend == "auto" and device.type == "cuda")):
        return None, None
    if backend == "triton" and not triton_kernels.available():
        raise RuntimeError("backend='triton' needs Triton: pip install triton (it comes with CUDA builds of torch)")
    triton_kernels.check_device(device)
    check = kernel_guard.check_kernels(device, {p.dtype for p in params}, config)
    if not check.passed:
        if check.passed is None:
            logger.warning("zocheck-ray: %s; the trainer on %s runs the eager path", check.reason, device)
        return None, check
    segments = [Segment(s.offset, s.numel, s.decay) for s in layout.params]
    return KernelStepper(segments, params, exp_avg, exp_avg_sq, config), check
