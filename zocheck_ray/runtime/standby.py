"""The standby's held image: a waiting CPU trainer copies the shadow's newest image in, so a promotion
offered it replays only the records after it."""

from __future__ import annotations

from zocheck_ray.config import JobConfig
from zocheck_ray.core import ZOOptimizer
from zocheck_ray.runtime.messages import AdapterIdentity
from zocheck_ray.runtime.publisher import ShadowLink
from zocheck_ray.runtime.restore import check_base


class Standby:
    """Which of the shadow's images a waiting trainer's state holds."""

    def __init__(self, job: JobConfig, shadow: ShadowLink):
        self.job, self.shadow = job, shadow
        self.held: tuple[str, int] | None = None  # (token, step); None during a copy

    @property
    def token(self) -> str | None:
        return self.held[0] if self.held is not None else None

    def preinstall(self, opt: ZOOptimizer, adapter: AdapterIdentity | None) -> int | None:
        """Copy the shadow's newest image into `opt` unless held; returns its step (None: no image, or
        one without a token to recognise)."""
        offer = self.shadow.borrow_image()
        if offer is None:
            return None
        try:
            if offer.token is None:
                return None
            if offer.token != self.token:
                self.held = None
                check_base(self.job, adapter, getattr(offer, "adapter", None))
                offer.copy_into(opt.state_tensors())
                self.held = (offer.token, offer.step)
            return offer.step
        finally:
            offer.release()

    def take(self, offer) -> bool:
        """Whether `offer` is the held image (no copy needed); forgets it: the state moves on."""
        token, self.held = self.token, None
        return token is not None and offer.token == token
