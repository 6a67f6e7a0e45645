"""Every error the controller acts on, in words it decides on: no Ray types, and nothing that loads torch or numba,
so the controller imports without them."""

from __future__ import annotations


class StageError(RuntimeError):
    """A stage of the shadow cannot go on; the message says which and why."""


class ShadowRestartedError(StageError):
    """A call meant for one incarnation of the shadow reached the next."""


class RoleError(RuntimeError):
    """A move between a trainer's roles that `runtime.trainer.TRANSITIONS` forbids."""


class RejoinRequiredError(RuntimeError):
    """Asked to train or hash before it rejoined (it waits, or its state is torn)."""


class ShadowGoneError(RuntimeError):
    """The shadow's process is gone for good: Ray will not restart it again."""


class ShadowCallError(RuntimeError):
    """A call to the shadow raised in the shadow (the cause is in the message)."""


class DrainFailedError(ShadowCallError):
    """The shadow could not replay and make durable what it was asked to (the cause is in the message)."""


def own_error(exc: BaseException) -> BaseException | None:
    """The zocheck-ray error `exc` is or carries, or None: a remote call's error reaches the caller as the `cause`
    of Ray's report, typed, so no caller reads Ray's text to find it."""
    for candidate in (getattr(exc, "cause", None), exc):
        if candidate is not None and any(c.__module__.startswith("zocheck_ray.") for c in type(candidate).__mro__):
            return candidate
    return None
