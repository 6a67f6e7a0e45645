"""How a run is asked to stop: SIGTERM and SIGINT, the same way.

The first signal stops the run at the next step boundary with its state durable and its lease
released, exiting with 128 + the signal's number; a second stops it at once, and the durable
state resumes it. Handlers are installed only from the main thread, and the previous ones put back.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunStopped(SystemExit):
    """The run was stopped by a signal; uncaught, the process exits with 128 + the signal's number and
    no traceback. `str()` says where the run stopped and what is durable."""

    def __init__(self, message: str, signum: int):
        super().__init__(128 + signum)
        self.message = message
        self.signum = signum

    def __str__(self) -> str:
        return self.message


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopRequest:
    """The stop signals of one run: the first is noted in `signum`; a second raises `RunStopped`."""

    def __init__(self):
        self.signum: int | None = None
        self.hurried = False
        self.describe_now = lambda: "the durable state resumes the run"

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
        """The stop of a run signalled before any actor started."""
        return RunStopped(f"stopped by {signal_name(self.signum)} before the run started: nothing of it was started "
                          "or written", self.signum)

    @contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        """Handle SIGTERM and SIGINT for the block (main thread only)."""
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
        """(Re-)install the handlers, since `ray.init` installs a SIGTERM handler of its own."""
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                signal.signal(s, self._handle)
