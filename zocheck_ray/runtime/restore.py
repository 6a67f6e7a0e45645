"""The restorer: the shadow's image into a trainer's tensors, then the records after it replayed on
the trainer's device, so the state is the lost trainer's, bit for bit. No image: a fresh start.
"""

from __future__ import annotations

import logging
import time

import torch

from zocheck_ray.config import JobConfig
from zocheck_ray.core import ZOOptimizer, replay, state_hash
from zocheck_ray.core.errors import StateMismatchError
from zocheck_ray.core.fused import default_threads
from zocheck_ray.core.gpu.triton_kernels import replay_on_device
from zocheck_ray.runtime.hooks import TrainerHooks
from zocheck_ray.runtime.messages import AdapterIdentity, RecoveryInfo
from zocheck_ray.runtime.publisher import ShadowLink
from zocheck_ray.workload.adapters import BaseModelMismatchError
from zocheck_ray.workload.models import snapshot_config

logger = logging.getLogger(__name__)


def check_base(job: JobConfig, mine: AdapterIdentity | None, recorded: AdapterIdentity | None) -> None:
    """Refuse to put a run's adapter on another base model than the one it was trained on."""
    if mine is None or (recorded is not None and recorded.base_hash == mine.base_hash):
        return
    was = f"SHA-256 {recorded.base_hash}" if recorded is not None else "not recorded (the image is not of an adapter run)"
    quantized = f" ({job.quantization.describe()}, quantized data and scales)" if job.quantization else ""
    raise BaseModelMismatchError(
        f"the base model {job.model!r}{quantized} this trainer built has weights SHA-256 {mine.base_hash}, but "
        f"the run {job.run_id!r} trained its adapter on a base whose weights hash {was}: recovering would put the "
        "adapter on another model. Restore the model directory (or model, dtype and run_seed) the run started "
        "with, or start a new run_id")


class Restorer:
    """Brings a trainer's state to what its shadow offers (`borrow`, then `restore`)."""

    def __init__(self, job: JobConfig, shadow: ShadowLink, device: torch.device, hooks: TrainerHooks,
                 incarnation: str):
        self.job, self.shadow, self.device, self.hooks, self.incarnation = job, shadow, device, hooks, incarnation

    @property
    def fresh_offer(self) -> bool:
        """Ask for a snapshot of the replica (`shadow.recovery_snapshot`): on the CPU, a replay costs more."""
        return self.job.shadow.recovery_snapshot and self.device.type == "cpu"

    def borrow(self, held: str | None = None):
        """The shadow's offer (None: no image) and its seconds; `held`: the token already in the state."""
        began = time.perf_counter()
        offer = self.shadow.borrow_image(fresh=self.fresh_offer, held=held)
        return offer, time.perf_counter() - began

    def restore(self, opt: ZOOptimizer, adapter: AdapterIdentity | None, offer, rank: int, may_start_fresh: bool,
                preinstalled: bool) -> tuple[RecoveryInfo, list]:
        """`opt` to the offer's step: its image (unless `preinstalled`), then its records; no offer starts
        fresh where `may_start_fresh` (built weights). Returns the recovery and the records replayed."""
        began = time.perf_counter()
        if offer is None:
            if not may_start_fresh or opt.step_index > 0:
                raise RuntimeError(f"rank {rank} must restore its state from the shadow, which holds no image "
                                   "(a shadow that was never initialized, or lost its image)")
            if rank == 0:  # the other ranks build the same initial state from run_seed
                if adapter is None:  # the config the snapshots carry (the run's dtype): transformers is loaded here
                    self.shadow.initialize(opt.state_tensors(), 0,
                                           model_config=snapshot_config(self.job.model, self.job.dtype))
                else:
                    self.shadow.initialize(opt.state_tensors(), 0, adapter=adapter)
            return RecoveryInfo(incarnation=self.incarnation, step=0, source="fresh"), []
        step, records, source = offer.step, offer.records, offer.source
        copy_seconds = None
        try:
            check_base(self.job, adapter, getattr(offer, "adapter", None))
            if not preinstalled:
                tensors = opt.state_tensors()
                copy_began = time.perf_counter()
                offer.copy_into(tensors)
                copy_seconds = time.perf_counter() - copy_began
        except BaseModelMismatchError:
            raise
        except ValueError as exc:  # the image is of another model or optimizer
            raise StateMismatchError(f"the shadow's image of step {step} does not fit this trainer: {exc}") from exc
        finally:
            offer.release()
        opt.step_index = step
        self.hooks.after_restore()
        loaded = time.perf_counter()
        replay_threads = None
        if records:
            live = opt.state_tensors()
            if self.device.type == "cpu":
                # on numba's whole pool: in a trainer process, more threads than cores (trainer_actor.py)
                replay_threads = default_threads()
                replay(live, records, self.job.zo, start_step=step, threads=replay_threads)
            else:  # the fused GPU kernels where they passed the start-up guard, else the eager oracle
                replay_on_device(live, records, self.job.zo, start_step=step, backend=opt.kernel_backend)
            opt.step_index = step + len(records)
        replayed = time.perf_counter()
        logger.info("trainer recovered at step %d from the %s image of step %d (+%d records)",
                    opt.step_index, source, step, len(records))
        digest = state_hash(opt.state_tensors()) if self.job.hash_every_step else None
        return RecoveryInfo(incarnation=self.incarnation, step=opt.step_index, source=source, image_step=step,
                            replayed_records=len(records), state_hash=digest, state_bytes=offer.layout.state_bytes,
                            preinstalled=preinstalled, copy_seconds=copy_seconds,
                            copy_threads=offer.threads if copy_seconds is not None else None,
                            read_through=offer.through if copy_seconds is not None else None,
                            install_seconds=loaded - began, replay_seconds=replayed - loaded,
                            replay_threads=replay_threads, hash_seconds=time.perf_counter() - replayed), records
