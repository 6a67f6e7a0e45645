"""Which Ray cluster `zocheck-ray train` and `zocheck-ray status` use, and what they say when it cannot
be reached, with real Ray processes.

The module's head node is its own (`ray start --head` with its own temp dir, ports and token, as a
cluster with token authentication is started); a `train` that starts a local instance runs with a
Ray temp dir of its own. Teardown stops only the processes whose command line names those
directories. Every wait is on a state (a line printed, a status that answers); a ceiling only bounds
a hang.
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from conftest import free_ports, stop_processes_naming
from support import REPO

pytestmark = pytest.mark.slow  # a `ray start --head` node, train drivers and their local instances

ENV_BIN = Path(sys.executable).parent
BOUND_SECONDS = 300  # a ceiling for a loaded machine, not a timing


def clean_env(ray_tmp: str, **extra: str) -> dict:
    """This environment without any Ray address or token, its Ray temp dir (where `ray start` records
    its cluster) `ray_tmp`, and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "RAY_TMPDIR": ray_tmp, "TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONPATH": str(REPO), **extra}


def cli(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zocheck_ray", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def head():
    """A token-authenticated head node recorded as this machine's `ray start` cluster for a client whose
    RAY_TMPDIR is `ray_tmp` (Ray looks for `<RAY_TMPDIR>/ray/ray_current_cluster`)."""
    ray_tmp = tempfile.mkdtemp(prefix="zcc", dir="/tmp")  # short: Ray's socket paths are length-limited
    temp_dir = os.path.join(ray_tmp, "ray")
    token = secrets.token_hex(32)
    env = clean_env(ray_tmp, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    flags = ["--port", "--ray-client-server-port", "--node-manager-port", "--object-manager-port",
             "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
             "--runtime-env-agent-port"]
    ports = dict(zip(flags, free_ports(len(flags))))
    start = [str(ENV_BIN / "ray"), "start", "--head", f"--temp-dir={temp_dir}", "--num-cpus=2", "--num-gpus=0",
             "--include-dashboard=false", "--disable-usage-stats", *[f"{k}={v}" for k, v in ports.items()]]
    try:
        started = subprocess.run(start, env=env, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, f"ray start --head failed:\n{started.stdout}\n{started.stderr}"
        recorded = Path(temp_dir, "ray_current_cluster").read_text().strip()
        yield {"ray_tmp": ray_tmp, "token": token, "gcs": f"127.0.0.1:{ports['--port']}", "recorded": recorded}
    finally:
        stop_processes_naming(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def test_status_against_a_token_cluster_says_what_is_missing(head, tmp_path):
    home = tmp_path / "home"  # no ~/.ray/auth_token there
    home.mkdir()
    env = clean_env(head["ray_tmp"], HOME=str(home))
    out = cli(env, "status", "some-run", "--address", head["gcs"])
    line = one_line(out.stderr)
    assert out.returncode == 2 and line.startswith("zocheck-ray status: ")
    assert f"the Ray cluster at {head['gcs']} uses token authentication and no token was found" in line
    assert "RAY_AUTH_TOKEN" in line

    out = cli({**env, "RAY_AUTH_TOKEN": "not-the-token"}, "status", "some-run", "--address", head["gcs"])
    line = one_line(out.stderr)
    assert out.returncode == 2 and f"the Ray cluster at {head['gcs']} refuses the token from RAY_AUTH_TOKEN" in line

    # with its token (and RAY_AUTH_MODE unset), status reaches the cluster and answers for the run
    out = cli({**env, "RAY_AUTH_TOKEN": head["token"]}, "status", "some-run", "--address", head["gcs"])
    assert out.returncode == 2, out.stderr
    assert "zocheck-ray status: no running shadow for run 'some-run' on the Ray cluster at" in out.stderr


def test_status_where_nothing_answers_is_one_line(head):
    (closed,) = free_ports(1)  # nothing listens there once the socket is closed
    out = cli(clean_env(head["ray_tmp"]), "status", "some-run", "--address", f"127.0.0.1:{closed}")
    assert out.returncode == 2
    assert f"no Ray cluster answers at 127.0.0.1:{closed}" in one_line(out.stderr)


@pytest.mark.parametrize("how", ["RAY_ADDRESS", "ray start"])
def test_train_says_which_cluster_it_joined_and_why(head, tmp_path, how):
    env = clean_env(head["ray_tmp"], RAY_AUTH_TOKEN=head["token"])
    if how == "RAY_ADDRESS":
        env["RAY_ADDRESS"] = head["gcs"]
    # more shadow CPUs than the head has: refused once connected, before any actor starts
    out = cli(env, "train", "--steps", "10", "--storage", str(tmp_path / "runs"), "--set", "shadow_cpus=8")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "shadow_cpus=8 plus one trainer CPU exceed the largest node" in out.stderr
    if how == "RAY_ADDRESS":  # (Ray names the cluster by the node's address, not 127.0.0.1)
        port = head["gcs"].rsplit(":", 1)[1]
        assert re.search(rf"^  ray: joined the cluster at \S+:{port} \(RAY_ADDRESS\)$", out.stdout, re.M), out.stdout
    else:
        assert f"  ray: joined the cluster at {head['recorded']} (the cluster `ray start` runs on this machine)" \
            in out.stdout, out.stdout
    assert "a local instance" not in out.stdout


@pytest.fixture
def local_train(tmp_path):
    """`zocheck-ray train` of a run that only ends when stopped, on a local instance it starts (no cluster
    to join: a Ray temp dir of its own); its output lines arrive in `lines`; stopped with SIGINT at the end."""
    ray_tmp = tempfile.mkdtemp(prefix="zcl", dir="/tmp")
    env = clean_env(ray_tmp)
    run_id = f"local-{uuid.uuid4().hex[:6]}"
    driver = subprocess.Popen(
        [sys.executable, "-m", "zocheck_ray", "train", "--steps", str(10**7), "--fail-at", "none", "--no-verify",
         "--storage", str(tmp_path / "runs"), "--set", f"run_id={run_id}", "--set", "log_interval=5"],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in driver.stdout], daemon=True)
    reader.start()  # drained all along, so the driver never blocks on a full pipe
    try:
        yield {"env": env, "run_id": run_id, "driver": driver, "lines": lines}
    finally:
        driver.send_signal(signal.SIGINT)
        try:
            driver.wait(timeout=120)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()
        stop_processes_naming(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_status_finds_a_run_on_the_local_instance_its_train_started(local_train):
    driver, run_id = local_train["driver"], local_train["run_id"]
    seen = []
    deadline = time.monotonic() + BOUND_SECONDS
    while not seen or "ray: " not in seen[-1]:  # the driver says where it runs, before the run starts
        seen.append(local_train["lines"].get(timeout=max(deadline - time.monotonic(), 0.1)))
    assert seen[-1].startswith("  ray: a local instance for this run at "), "".join(seen)
    address = seen[-1].split(" at ", 1)[1].split()[0]

    while True:  # until the trainer has run a step (the shadow exists from the run's start)
        out = cli(local_train["env"], "status", run_id, "--json")
        if out.returncode == 0 and json.loads(out.stdout)["trainer_step"] > 0:
            break
        assert driver.poll() is None and time.monotonic() < deadline, out.stderr
        time.sleep(0.5)
    assert json.loads(out.stdout)["run_id"] == run_id
    # the address it printed reaches the same run
    out = cli(local_train["env"], "status", run_id, "--json", "--address", address)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["run_id"] == run_id
