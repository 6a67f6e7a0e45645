"""`replay_reference`: replay step records in eager torch, on any device, in place."""

from __future__ import annotations

from typing import Sequence

import torch

from zocheck_ray.core import update
from zocheck_ray.core.config import ZOConfig
from zocheck_ray.core.generator import perturbation
from zocheck_ray.core.record import StepRecord
from zocheck_ray.core.seeds import perturbation_seeds
from zocheck_ray.core.validation import check_replay


@torch.no_grad()
def replay_reference(state: dict[str, torch.Tensor], records: Sequence[StepRecord], config: ZOConfig,
                     *, start_step: int) -> dict[str, torch.Tensor]:
    """Apply `records` to `state` in order, with the trainer's exact operation sequence (z generated once per step
    and chunk)."""
    layout, all_scalars = check_replay(state, records, config, start_step)
    for record, s in zip(records, all_scalars):
        seeds = perturbation_seeds(record.seed, len(record.grads))
        for i, spec in enumerate(layout.params):
            flat = state[spec.name].view(-1)
            dtype = flat.dtype
            for a, b in update.chunks(spec.numel):
                zds = [update.cast_perturbation(perturbation(seed, spec.offset + a, b - a, config.perturbation,
                                                             flat.device), dtype) for seed in seeds]
                p = flat[a:b].float()
                mask = update.sparse_mask(p, record.extras[i]) if config.optimizer == "sparse-mezo" else None
                p = update.perturb_all(p, zds, s, dtype, mask)
                p = update.update_chunk(state, spec.name, a, b, p, zds, s, spec.decay, dtype, config.optimizer, mask)
                flat[a:b].copy_(p)
    return state
