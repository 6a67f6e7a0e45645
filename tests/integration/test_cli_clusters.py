"""Which Ray cluster `zocheck-ray train` and `zocheck-ray status` use, what they say when it cannot
be reached, and how SIGTERM and SIGINT stop a `train` driver, with real Ray processes.

The module's head node is its own (`ray start --head` with its own temp dir, ports and token, as a
cluster with token authentication is started); a `train` that starts a local instance runs with a
Ray temp dir of its own. Teardown stops only the processes whose command line names those
directories. Every wait is on a state (a line printed, a status that answers); a ceiling only bounds
a hang.
"""

from __future__ import annotations

import json
import os
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

from conftest import CLUSTER_ENV, free_ports, processes_naming, stop_processes_naming
from support import REPO, stop_driver, wait_until

pytestmark = pytest.mark.slow  # a `ray start --head` node, train drivers and their local instances

ENV_BIN = Path(sys.executable).parent
BOUND_SECONDS = 300  # a ceiling for a loaded machine, not a timing


def clean_env(ray_tmp: str, **extra: str) -> dict:
    """This environment without any Ray address or token, its Ray temp dir (where `ray start` records
    its cluster) `ray_tmp`, and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "RAY_TMPDIR": ray_tmp, "TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONPATH": str(REPO), CLUSTER_ENV: ray_tmp, **extra}


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
    out = cli({**env, "RAY_AUTH_MODE": "token"}, "status", "some-run", "--address", head["gcs"])
    line = one_line(out.stderr)  # said before Ray connects
    assert out.returncode == 2 and line.startswith("zocheck-ray status: ")
    assert f"RAY_AUTH_MODE=token but no token was found for the Ray cluster at {head['gcs']}" in line
    assert "RAY_AUTH_TOKEN" in line

    # a token it refuses: the cluster is asked before Ray connects (Ray would retry for about 20 s, each try a
    # warning), and the one line says which token
    out = cli({**env, "RAY_AUTH_TOKEN": "not-the-token"}, "status", "some-run", "--address", head["gcs"])
    line = one_line(out.stderr)
    assert out.returncode == 2 and line.startswith(f"zocheck-ray status: the Ray cluster at {head['gcs']} did not let "
                                                   "this process connect; it refuses the token from RAY_AUTH_TOKEN")

    # its token, in a mode that keeps Ray from sending it: said before connecting too
    out = cli({**env, "RAY_AUTH_TOKEN": head["token"], "RAY_AUTH_MODE": "disabled"}, "status", "some-run",
              "--address", head["gcs"])
    assert out.returncode == 2 and one_line(out.stderr) == (
        f"zocheck-ray status: the Ray cluster at {head['gcs']} uses token authentication; RAY_AUTH_MODE=disabled "
        "keeps Ray from sending the token from RAY_AUTH_TOKEN: set RAY_AUTH_MODE=token; a finished run's figures are "
        "in its `train --json` summary and `zocheck-ray verify STORAGE/RUN_ID`"), out.stderr

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
    out = cli(env, "train", "--steps", "10", "--storage", str(tmp_path / "runs"), "--set", "shadow.cpus=8")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "shadow.cpus=8 plus one trainer CPU exceed the largest node" in out.stderr
    if how == "RAY_ADDRESS":  # (Ray names the cluster by the node's address, not 127.0.0.1)
        port = head["gcs"].rsplit(":", 1)[1]
        assert re.search(rf"^  ray: joined the cluster at \S+:{port} \(RAY_ADDRESS\)$", out.stdout, re.M), out.stdout
    else:
        assert f"  ray: joined the cluster at {head['recorded']} (the cluster `ray start` runs on this machine)" \
            in out.stdout, out.stdout
    assert "a local instance" not in out.stdout


class DriverOutput:
    """A driver's output lines (stdout and stderr), read all along so the driver never blocks on a full pipe."""

    def __init__(self, driver: subprocess.Popen):
        self.lines: list[str] = []
        self.ended = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(driver,), daemon=True).start()

    def _read(self, driver: subprocess.Popen) -> None:
        for line in driver.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def wait_for(self, pattern: str, after: int = 0) -> tuple[int, re.Match]:
        """The first line from index `after` on that `pattern` matches (from its start): (index, match)."""
        deadline = time.monotonic() + BOUND_SECONDS
        with self._changed:
            while True:
                for i in range(after, len(self.lines)):
                    if (match := re.match(pattern, self.lines[i])) is not None:
                        return i, match
                remaining = deadline - time.monotonic()
                assert not self.ended and remaining > 0, f"no line matches {pattern!r}:\n" + "\n".join(self.lines)
                self._changed.wait(remaining)

    def wait_for_end(self) -> list[str]:
        with self._changed:
            assert self._changed.wait_for(lambda: self.ended, BOUND_SECONDS), "\n".join(self.lines)
            return list(self.lines)


def train_args(storage: Path, run_id: str) -> list[str]:
    """`zocheck-ray train` of the embedded job for a run that only ends when it is stopped."""
    return ["train", "--steps", str(10**7), "--fail-at", "none", "--no-verify", "--storage", str(storage),
            "--set", f"run_id={run_id}", "--set", "log_interval=5"]


def start_train(env: dict, args: list[str]) -> tuple[subprocess.Popen, DriverOutput]:
    driver = subprocess.Popen([sys.executable, "-m", "zocheck_ray", *args], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return driver, DriverOutput(driver)


class LocalTrain:
    """`zocheck-ray train` of a run that only ends when stopped, on a local instance it starts (no cluster
    to join: a Ray temp dir of its own). The module's tests share it: one stops it and starts it again,
    the next ones use the driver running then (`driver`, `output`)."""

    def __init__(self, storage: Path):
        self.ray_tmp = tempfile.mkdtemp(prefix="zcl", dir="/tmp")
        self.env = clean_env(self.ray_tmp)
        self.run_id = f"local-{uuid.uuid4().hex[:6]}"
        self.storage = storage
        self.started: list[subprocess.Popen] = []
        self.start()

    def start(self) -> None:
        self.driver, self.output = start_train(self.env, train_args(self.storage, self.run_id))
        self.started.append(self.driver)

    def close(self) -> None:
        for driver in self.started:
            stop_driver(driver)
        stop_processes_naming(self.ray_tmp)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def local_train(tmp_path_factory):
    """The module's `LocalTrain`; whatever still runs at the end is stopped (SIGINT, then the processes
    naming its Ray temp dir)."""
    train = LocalTrain(tmp_path_factory.mktemp("local-train") / "runs")
    try:
        yield train
    finally:
        train.close()


STOPPED = (r"  stopped by {signal} at step (\d+): its state is durable in (\S+); the run's lease is released; run "
           r"the same job again to resume it$")


def stop_with(train: LocalTrain, sig: signal.Signals, after: int = 0) -> tuple[int, int]:
    """Send `sig` to the training driver once it printed a step line from line `after` on; (its exit status,
    the step it says it stopped at), once its last line said so and nothing of its Ray instance is left."""
    driver, output = train.driver, train.output
    output.wait_for(r"  step +\d+ ", after)
    driver.send_signal(sig)
    lines = output.wait_for_end()
    driver.wait(timeout=BOUND_SECONDS)
    text = "\n".join(lines)
    assert not any(word in text for word in ("Traceback", "Aborted", "core dumped", "*** ")), text
    stopped = re.match(STOPPED.format(signal=sig.name), lines[-1])
    assert stopped is not None, text  # one line, the last, says where it stopped and what is durable
    assert wait_until(lambda: not processes_naming(train.ray_tmp), timeout=60)  # its Ray instance went with it
    return driver.returncode, int(stopped.group(1))


def durable_snapshot(train: LocalTrain):
    from zocheck_ray.storage import SnapshotStore

    return SnapshotStore(str(train.storage / train.run_id), create=False).latest()


def lease_released(train: LocalTrain) -> bool:
    from zocheck_ray.storage import read_lease
    from zocheck_ray.storage.fs import open_storage

    lease = read_lease(open_storage(str(train.storage / train.run_id), create=False))
    return lease is not None and lease.released


def test_sigterm_stops_train_at_a_step_boundary_and_a_rerun_at_once_resumes_exactly(local_train):
    from zocheck_ray.config import load_job_config
    from zocheck_ray.demo import EMBEDDED_DEFAULT
    from zocheck_ray.testing.reference import uninterrupted_hashes

    code, step = stop_with(local_train, signal.SIGTERM)
    assert code == 143  # 128 + SIGTERM, as a scheduler expects
    assert lease_released(local_train)  # a rerun, here or on another cluster, takes it at once
    stopped = durable_snapshot(local_train)
    assert stopped.step == step

    # Started at once, as a Kubernetes retry would be: the same command resumes where it stopped, and its
    # startup profile makes the image of a later step durable (once it has printed a step line).
    local_train.start()
    resumed, _ = local_train.output.wait_for(rf"  resumed at step {step} from durable storage \(its newest sound "
                                             r"snapshot and the logged records after it\)$")
    local_train.output.wait_for(r"  step +\d+ ", resumed)
    later = durable_snapshot(local_train)
    assert later.step > step
    job = load_job_config(None, [f"run_id={local_train.run_id}", "log_interval=5"], base=EMBEDDED_DEFAULT,
                          steps=later.step, storage=str(local_train.storage))
    expected = uninterrupted_hashes(job)
    assert (stopped.state_hash, later.state_hash) == (expected[step], expected[later.step])


def test_status_finds_a_run_on_the_local_instance_its_train_started(local_train):
    driver, run_id, output = local_train.driver, local_train.run_id, local_train.output
    # the driver says where it runs, before the run starts
    _, ray_line = output.wait_for(r"  ray: ")
    assert ray_line.string.startswith("  ray: a local instance for this run at "), "\n".join(output.lines)
    address = ray_line.string.split(" at ", 1)[1].split()[0]

    # once the driver printed a step line (a step is on the shadow then): each `status` is a process of its own
    output.wait_for(r"  step +\d+ ")
    out = cli({**local_train.env, "PYTHONPROFILEIMPORTTIME": "1"}, "status", run_id, "--json")
    assert out.returncode == 0 and driver.poll() is None, out.stderr
    assert json.loads(out.stdout)["run_id"] == run_id and json.loads(out.stdout)["trainer_step"] > 0
    # it reads the shadow's metrics without loading torch or the model's libraries (a second, not several)
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "zocheck_ray.runtime.messages" in imported
    assert not {"torch", "transformers", "numba"} & imported, sorted({"torch", "transformers", "numba"} & imported)
    # the address it printed reaches the same run
    out = cli(local_train.env, "status", run_id, "--json", "--address", address)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["run_id"] == run_id


def test_sigint_stops_train_the_same_way(local_train):
    code, step = stop_with(local_train, signal.SIGINT)
    assert code == 130  # 128 + SIGINT
    assert lease_released(local_train)
    assert durable_snapshot(local_train).step == step
