"""What the driver is told when a run's processes fail, in words the controller decides on (no Ray types)."""

from __future__ import annotations


class ShadowGoneError(RuntimeError):
    """The shadow's process is gone for good: Ray will not restart it again."""


class ShadowCallError(RuntimeError):
    """A call to the shadow raised in the shadow (the cause is in the message)."""


class DrainFailedError(ShadowCallError):
    """The shadow could not replay and make durable what it was asked to (the cause is in the message)."""
