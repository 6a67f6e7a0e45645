"""The seams where tests and the demonstration reach into a trainer or a shadow process.

Production passes `NO_HOOKS`. Ray restarts an actor with its constructor's arguments, so an
implementation keeps its own record of what it already did.
"""

from __future__ import annotations

from typing import Protocol


class TrainerHooks(Protocol):
    steps_hooked: bool
    """Whether `before_step` does anything (the training loop calls it only then)."""

    def before_step(self, rank: int, step: int) -> None:
        """Called before rank `rank` runs `step`."""

    def before_exchange(self, rank: int, step: int, exchange: int) -> None:
        """Called before data-parallel rank `rank` sends its shards' losses of `step`'s `exchange`-th exchange
        (0: at +eps)."""

    def after_exchange_failed(self, rank: int, step: int, exchange: int) -> None:
        """Called when elastic rank `rank`'s exchange failed."""

    def before_regroup(self, rank: int, generation: int) -> None:
        """Called before elastic rank `rank` joins the planned group `generation`."""

    def after_restore(self) -> None:
        """Called once a restored state is in place, before its records are replayed."""

    def before_build(self, standby: bool) -> None:
        """Called before a trainer process builds its model (`standby`: it was created as the warm standby)."""


class ShadowHooks(Protocol):
    replay_stalled: bool
    """The replay applies no record: only resyncs move the replica (a shadow behind however slow the trainer)."""

    def after_replay(self, steps: int) -> None:
        """Called after the shadow replayed `steps` records."""


class NoHooks:
    """Production: nothing is injected."""

    steps_hooked = False
    replay_stalled = False

    def before_step(self, rank: int, step: int) -> None:
        pass

    def before_exchange(self, rank: int, step: int, exchange: int) -> None:
        pass

    def after_exchange_failed(self, rank: int, step: int, exchange: int) -> None:
        pass

    def before_regroup(self, rank: int, generation: int) -> None:
        pass

    def after_restore(self) -> None:
        pass

    def before_build(self, standby: bool) -> None:
        pass

    def after_replay(self, steps: int) -> None:
        pass


NO_HOOKS = NoHooks()
