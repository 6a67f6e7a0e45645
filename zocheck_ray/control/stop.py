"""How a run is asked to stop: SIGTERM (Kubernetes, KubeRay, `ray job stop`, a scheduler) and SIGINT
(Ctrl-C), the same way.

The first signal is noted, nothing more: the controller stops at the next step boundary every
trainer has reached (the end of the segment in flight), makes what the shadow holds durable,
releases the run's lease, says so in one line and raises `RunStopped`, which exits the process
with 128 + the signal's number (143 for SIGTERM, 130 for SIGINT) and no traceback. A second
signal stops at once (`RunStopped` raised where the driver is): the actors are killed (further
signals are ignored meanwhile) and the durable state resumes the run.

Handlers are installed only while a run is driven from the main thread (a Tune trial's driver
is not: its trial's own stop applies), and the ones found are put back afterwards. They are
installed before the run's checks and again once Ray is connected (`ray.init` installs a
SIGTERM handler of its own): a signal while `ray.init` itself runs meets Ray's handler.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunStopped(SystemExit):
    """The run was stopped by a signal; uncaught, the process exits with `code` (128 + the signal's number)
    without a traceback. `str()` is the one line that says where the run stopped and what is durable."""

    def __init__(self, message: str, signum: int):
        super().__init__(128 + signum)
        self.message = message
        self.signum = signum

    def __str__(self) -> str:
        return self.message


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopRequest:
    """The stop signals of one run: `signum` once the first arrived; a second one raises `RunStopped`."""

    def __init__(self):
        self.signum: int | None = None
        """The first stop signal received (None: keep going)."""
        self.hurried = False
        """A second signal came: stop at once, without waiting for anything."""
        self.describe_now = lambda: "the durable state resumes the run"
        """What to say if a second signal stops the run at once (set by the controller)."""

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
            return
        if self.hurried:  # already stopping at once: the actors are being killed
            return
        self.hurried = True
        raise RunStopped(f"stopped at once by a second {signal_name(signum)}: {self.describe_now()}", self.signum)

    def before_start(self) -> RunStopped:
        """The stop of a run whose signal came before any of its actors started."""
        return RunStopped(f"stopped by {signal_name(self.signum)} before the run started: nothing of it was started "
                          "or written", self.signum)

    @contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        """Handle SIGTERM and SIGINT for the duration of the block (from the main thread only); the handlers
        found are put back afterwards."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        self.install()
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def install(self) -> None:
        """(Re-)install the handlers: `ray.init` installs a SIGTERM handler of its own (it exits at once)."""
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                signal.signal(s, self._handle)
