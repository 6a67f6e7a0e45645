"""The process template (`actors/template.py`) without Ray: a stand-in for the raylet starts the launcher on
a stand-in for Ray's `default_worker.py`, as Ray's `setup_worker.py` does (the launcher's parent is the
raylet), and the template preloads a probe module (`ZOCHECK_RAY_TEMPLATE_PRELOAD`) instead of torch.
tests/integration/test_process_template.py runs the real one under Ray."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support import wait_until
from zocheck_ray.actors import template

pytestmark = pytest.mark.skipif(not template.available(), reason="process templates need Linux")

RAYLET = """
import os, subprocess, sys, time
for run in range(int(os.environ.get("RUNS", "1"))):
    child = subprocess.Popen(sys.argv[1:], env={**os.environ, "RUN": str(run), "RAYLET_PID": str(os.getpid())})
    print("launcher", child.pid, flush=True)
    print("exit", child.wait(), flush=True)
time.sleep(3600)
"""
"""Starts the command (the launcher; `RUNS` times, one after the other), reports its pid and exit status,
and lives on until killed."""

WORKER = """
import json, os, random, signal, sys, time
out, action = sys.argv[1] + os.environ.get("RUN", "0"), sys.argv[2]
info = {"pid": os.getpid(), "ppid": os.getppid(), "forked": os.environ.get("ZOCHECK_RAY_TEMPLATE_PID"),
        "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "random": random.random(),
        "preloaded": "template_probe" in sys.modules, "name": __name__, "marker": os.environ.get("PROBE"),
        "sid": os.getsid(0), "pgid": os.getpgid(0), "raylet_sid": os.getsid(int(os.environ["RAYLET_PID"])),
        "template_sid": os.getsid(os.getppid())}
if action == "handles":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
with open(out + ".tmp", "w") as f:
    json.dump(info, f)
os.replace(out + ".tmp", out)
print("worker up", flush=True)
if action == "exit":
    sys.exit(int(sys.argv[3]))
while True:
    time.sleep(3600)
"""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"  # a zombie has ended
    except FileNotFoundError:
        return True


def start_node(tmp: Path, action: str, *args: str, preload: str = "template_probe",
               runs: int = 1) -> tuple[subprocess.Popen, Path]:
    """A raylet stand-in that runs the launcher on the stand-in worker with `action`; (it, the worker's info file)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "template_probe.py").write_text("PROBED = True\n")
    (tmp / "thread_probe.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n")
    worker = tmp / "ray" / "default_worker.py"
    worker.parent.mkdir(exist_ok=True)
    worker.write_text(WORKER)
    out = tmp / "info"
    env = {**os.environ, "PYTHONPATH": str(tmp), template.PRELOAD_ENV: preload, "PROBE": "1", "RUNS": str(runs)}
    raylet = subprocess.Popen([sys.executable, "-c", RAYLET, sys.executable, template.__file__, str(worker),
                               str(out), action, *args], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp)
    return raylet, out


def read_info(out: Path, run: int = 0) -> dict:
    path = out.with_name(f"{out.name}{run}")
    assert wait_until(path.exists), f"no {path.name}"
    return json.loads(path.read_text())


def line(raylet: subprocess.Popen, prefix: str) -> str:
    while True:
        text = raylet.stdout.readline()
        assert text, f"the node's output ended before a line starting {prefix!r}"
        if text.startswith(prefix):
            return text[len(prefix):].strip()


@pytest.fixture
def nodes():
    started: list[subprocess.Popen] = []
    yield started
    for raylet in started:
        raylet.kill()
        raylet.wait()


def test_a_worker_runs_forked_from_the_template_as_a_fresh_interpreter_would(tmp_path, nodes):
    """The worker: forked from the template (its parent, preloaded module in place), in the raylet's session
    (where the scheduler groups by session, a session of its own would take CPU as all of Ray's workers together
    do) and a process group of its own, with the launcher's arguments, environment, directory, module path and
    standard output; the launcher ends with its exit status."""
    raylet, out = start_node(tmp_path / "a", "exit", "3")
    nodes.append(raylet)
    info = read_info(out)
    assert info["forked"] is not None and int(info["forked"]) == info["ppid"] != raylet.pid
    assert info["preloaded"] is True and info["name"] == "__main__" and info["marker"] == "1"
    assert info["argv"] == [str(tmp_path / "a" / "ray" / "default_worker.py"), str(out), "exit", "3"]
    assert info["cwd"] == str(tmp_path / "a") and info["path0"] == str(tmp_path / "a" / "ray")
    assert info["sid"] == info["template_sid"] == info["raylet_sid"] != info["pid"] and info["pgid"] == info["pid"]
    assert line(raylet, "worker up") == ""  # the worker wrote to the launcher's standard output
    assert line(raylet, "exit ") == "3"
    assert not gone(info["ppid"])  # the template serves on


def test_workers_of_one_template_share_it_and_draw_different_random_numbers(tmp_path, nodes):
    raylet, out = start_node(tmp_path / "a", "exit", "0", runs=2)
    nodes.append(raylet)
    one, two = read_info(out, 0), read_info(out, 1)
    assert one["forked"] == two["forked"] == str(one["ppid"]) and two["ppid"] == one["ppid"]
    assert two["pid"] != one["pid"] and two["random"] != one["random"]


def test_signals_pass_to_the_worker_and_the_launcher_ends_as_it_does(tmp_path, nodes):
    raylet, out = start_node(tmp_path / "a", "handles")
    nodes.append(raylet)
    launcher = int(line(raylet, "launcher "))
    info = read_info(out)
    os.kill(launcher, signal.SIGTERM)
    assert line(raylet, "exit ") == "7"  # the worker's handler ran and exited 7
    raylet, out = start_node(tmp_path / "b", "wait")
    nodes.append(raylet)
    launcher = int(line(raylet, "launcher "))
    info = read_info(out)
    os.kill(launcher, signal.SIGTERM)
    assert line(raylet, "exit ") == str(-signal.SIGTERM)  # killed by it: so is the launcher
    assert gone(info["pid"])


def test_a_worker_killed_ends_its_launcher_and_a_launcher_killed_ends_its_worker(tmp_path, nodes):
    raylet, out = start_node(tmp_path / "a", "wait")
    nodes.append(raylet)
    line(raylet, "launcher ")
    info = read_info(out)
    os.kill(info["pid"], signal.SIGKILL)
    assert line(raylet, "exit ") == str(-signal.SIGKILL)
    raylet, out = start_node(tmp_path / "b", "wait")
    nodes.append(raylet)
    launcher = int(line(raylet, "launcher "))
    info = read_info(out)
    os.kill(launcher, signal.SIGKILL)
    assert wait_until(lambda: gone(info["pid"]))  # the worker of a killed launcher ends


def test_the_template_ends_with_its_raylet_and_a_lost_template_leaves_its_workers_running(tmp_path, nodes):
    raylet, out = start_node(tmp_path / "a", "wait")
    nodes.append(raylet)
    launcher = int(line(raylet, "launcher "))
    info = read_info(out)
    os.kill(info["ppid"], signal.SIGKILL)  # the template
    assert wait_until(lambda: gone(info["ppid"]))
    assert not gone(info["pid"]) and not gone(launcher)  # the worker runs on; its launcher waits for it
    os.kill(info["pid"], signal.SIGKILL)
    assert line(raylet, "exit ") == "1"  # its status went with the template
    raylet, out = start_node(tmp_path / "b", "exit", "0")
    info = read_info(out)
    assert line(raylet, "exit ") == "0"
    raylet.kill()  # the raylet stand-in ends: so does its template
    raylet.wait()
    assert wait_until(lambda: gone(info["ppid"]))  # the template of an ended raylet ends


def test_a_template_that_runs_a_thread_does_not_fork_and_the_worker_starts_the_usual_way(tmp_path, nodes):
    raylet, out = start_node(tmp_path / "a", "exit", "5", preload="template_probe,thread_probe")
    nodes.append(raylet)
    info = read_info(out)
    assert info["forked"] is None and info["preloaded"] is False  # exec'd: a fresh interpreter
    assert info["ppid"] == raylet.pid and info["path0"] == str(tmp_path / "a" / "ray")
    assert line(raylet, "exit ") == "5"


def test_the_key_names_the_environment_the_imports_depend_on():
    base = {"PATH": "/bin", "HF_HOME": "/a", "RAY_JOB_ID": "01"}
    key = template.template_key(base, "/py", ["/lib"], 10)
    assert template.template_key({**base, "RAY_JOB_ID": "02"}, "/py", ["/lib"], 10) == key
    for changed in ({**base, "HF_HOME": "/b"}, {**base, "OMP_NUM_THREADS": "2"}):
        assert template.template_key(changed, "/py", ["/lib"], 10) != key
    assert template.template_key(base, "/py2", ["/lib"], 10) != key
    assert template.template_key(base, "/py", ["/lib", "/x"], 10) != key
    assert template.template_key(base, "/py", ["/lib"], 11) != key


def test_a_template_serves_only_its_own_user_and_a_launcher_talks_only_to_its_own_users_template():
    """The abstract namespace is open to every user of the host: a template refuses another user's launcher
    (before it reads the request), and a launcher refuses a socket another user holds (it would hand over its
    environment). Both compare the kernel's peer credentials with their user (here, another one given)."""
    name = template.address(f"test-{os.getpid()}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen(4)
    try:
        with pytest.raises(PermissionError, match="held by uid"):
            template._connected(name, uid=os.getuid() + 1)
        listener.accept()[0].close()  # that connection, closed by its launcher
        served = template._Template(listener, os.getpid(), uid=os.getuid() + 1)
        client = template._connected(name)
        client.settimeout(60)  # a regression fails rather than hangs
        served._accept()
        answer, _ = template._receive(client)
        assert "refused" in answer and "not the template's user" in answer["refused"]
        assert client.recv(1) == b""  # and closed
        client.close()
    finally:
        listener.close()


def test_a_message_is_read_without_a_byte_of_the_next():
    """The template's answer and the worker's exit status can arrive together: each is read on its own."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        template._send(theirs, {"pid": 7})
        template._send(theirs, {"status": 0})
        theirs.shutdown(socket.SHUT_WR)
        assert template._receive(ours) == ({"pid": 7}, [])
        assert template._receive(ours) == ({"status": 0}, [])
        assert template._receive(ours) == (None, [])
