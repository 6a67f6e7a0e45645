"""SIGTERM and SIGINT to a run's driver, without Ray: the first is noted (the controller stops at the
next step boundary), a second stops at once, and the handlers found before are put back."""

import os
import signal
import threading

import pytest

from zocheck_ray.control import RunStopped
from zocheck_ray.control.stop import StopRequest

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="signal handlers are installed from the main thread only")


def test_the_first_signal_is_noted_and_the_run_goes_on():
    with StopRequest().installed() as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # handled here, at the next bytecode: the process lives on
        assert stop.requested and stop.signum == signal.SIGTERM and not stop.hurried


def test_a_second_signal_stops_at_once_with_the_first_ones_exit_status():
    with StopRequest().installed() as stop:
        stop.describe_now = lambda: "at step 12; the durable state resumes the run"
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(RunStopped) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # while the actors are being killed: ignored
    assert stopped.value.code == 130 and isinstance(stopped.value, SystemExit)
    assert str(stopped.value) == "stopped at once by a second SIGTERM: at step 12; the durable state resumes the run"


def test_the_handlers_found_are_put_back():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with StopRequest().installed() as stop:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as `ray.init` installs its own
        stop.install()
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, before[signal.SIGTERM])
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_signal_before_the_run_started_says_nothing_was_started():
    with StopRequest().installed() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
    stopped = stop.before_start()
    assert stopped.code == 143 and "before the run started: nothing of it was started" in str(stopped)
