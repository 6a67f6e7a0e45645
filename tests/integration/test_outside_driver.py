"""A driver of its own (`zocheck-ray train --address`, a process beside the cluster) joins a cluster and runs a short
job to `verified`; two more drivers of its run, one started together with it and one while it runs, are each
refused in one line, and the first goes on untouched. Here: `ray start --head` and a `ray.cluster_utils.Cluster` of
two nodes; test_outside_driver_jobs.py: a Cluster of one node, and jobs sent to it with `ray job submit`.

`ray start --head` uses token authentication (Ray 2.60 turns it on for the token at hand); a Cluster's processes use
none. Every driver has a token at hand (`~/.ray/auth_token`, as on a machine where a local `ray.init()` once ran):
with it, a driver that took token mode for a cluster without it refused the cluster's own calls back, and Ray ended
the run's shadow before it ran (issue 64).

Each cluster is its module's own (its own temp dir, free ports, a home directory of its own), started when a test
first needs it and stopped, with every process naming its temp dir, when the module ends. Tests wait on states (a
line printed, a process ended); a driver that must still be running while another starts is held with SIGSTOP once
it has printed its start line, and let go once the other has ended.
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
import urllib.request
import uuid
from pathlib import Path

import pytest

from conftest import free_ports, processes_naming, stop_processes_naming
from support import REPO, wait_until
from test_cli_clusters import BOUND_SECONDS, DriverOutput, clean_env

pytestmark = pytest.mark.slow  # clusters of their own, and drivers that each import torch

ENV_BIN = Path(sys.executable).parent
STEPS = 60
"""Enough for the run to be still training when its driver is held after its start line."""
TRAIN_ARGS = ["--steps", str(STEPS), "--fail-at", "none", "--set", "shadow.snapshot_interval=20",
              "--set", "log_interval=20"]
REFUSED = (r"^zocheck-ray train: run '{run_id}' is already running on this Ray cluster: .*zocheck-shadow-{run_id}\b"
           r".*\. One job per run: stop that job .* or give this job another run_id$")

HOLD_CLUSTER = """
import sys
from ray.cluster_utils import Cluster

nodes, dashboard, agent_ports = int(sys.argv[1]), int(sys.argv[2]), [int(p) for p in sys.argv[3:]]
head = {"num_cpus": 1 if nodes > 1 else 4, "dashboard_agent_listen_port": agent_ports[0],
        **({"dashboard_port": dashboard, "dashboard_host": "127.0.0.1"} if dashboard else {"include_dashboard": False})}
cluster = Cluster(initialize_head=True, head_node_args=head)
for port in agent_ports[1:nodes]:
    cluster.add_node(num_cpus=4, dashboard_agent_listen_port=port)
cluster.wait_for_nodes()
print(cluster.address, flush=True)
sys.stdin.read()  # until the test closes it
cluster.shutdown()
"""
"""A `ray.cluster_utils.Cluster` as a user starts one in a Python process: the head (one CPU where there are two
nodes, so the run goes to the second), the other node with four."""


class JoinedCluster:
    """One cluster of a kind, and the environment of a process on this machine that joins it."""

    def __init__(self, kind: str, home: Path):
        self.kind = kind
        self.ray_tmp = tempfile.mkdtemp(prefix="zod", dir="/tmp")  # short: Ray's socket paths are length-limited
        # numba's kernels from the cache the suite compiled them into, not compiled again under the new home
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        self.env = clean_env(self.ray_tmp, HOME=str(home), XDG_CACHE_HOME=cache)
        self.holder: subprocess.Popen | None = None
        self.dashboard: str | None = None
        try:
            self.gcs = self._start_head() if kind == "ray start --head" else self._start_cluster(kind)
        except BaseException:
            self.stop()
            raise

    def _start_head(self) -> str:
        flags = ["--port", "--ray-client-server-port", "--node-manager-port", "--object-manager-port",
                 "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
                 "--runtime-env-agent-port"]
        ports = dict(zip(flags, free_ports(len(flags))))
        start = [str(ENV_BIN / "ray"), "start", "--head", f"--temp-dir={self.ray_tmp}/ray", "--num-cpus=4",
                 "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats",
                 *[f"{k}={v}" for k, v in ports.items()]]
        started = subprocess.run(start, env=self.env, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, f"ray start --head failed:\n{started.stdout}\n{started.stderr}"
        return f"127.0.0.1:{ports['--port']}"

    def _start_cluster(self, kind: str) -> str:
        nodes = 2 if kind == "Cluster of two nodes" else 1
        dashboard, *agents = free_ports(1 + nodes)
        if nodes == 1:  # the one-node Cluster takes jobs: `ray job submit` reaches its dashboard
            self.dashboard = f"http://127.0.0.1:{dashboard}"
        # from the environment activated, as a user starts it: a job's `python3` is the environment's
        env = {**self.env, "PATH": os.pathsep.join([str(ENV_BIN), "/usr/local/bin", "/usr/bin", "/bin"])}
        self.holder = subprocess.Popen(
            [sys.executable, "-c", HOLD_CLUSTER, str(nodes), str(dashboard if nodes == 1 else 0), *map(str, agents)],
            env=env, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        address = self.holder.stdout.readline().strip()
        assert address, f"the {kind} did not start"
        return address

    def stop(self) -> None:
        if self.holder is not None and self.holder.poll() is None:
            self.holder.stdin.close()
            try:
                self.holder.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.holder.kill()
        stop_processes_naming(self.ray_tmp)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A home directory with a token at hand, as a local `ray.init()` leaves it (`~/.ray/auth_token`)."""
    home = tmp_path_factory.mktemp("home")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    return home


@pytest.fixture(scope="module")
def clusters(home):
    """`clusters(kind)`: the module's cluster of that kind (jobs go to the one-node Cluster), started on first use."""
    started: dict[str, JoinedCluster] = {}

    def cluster(kind: str) -> JoinedCluster:
        kind = "Cluster of one node" if kind == "ray job submit" else kind
        if kind not in started:
            started[kind] = JoinedCluster(kind, home)
        return started[kind]

    try:
        yield cluster
    finally:
        for each in started.values():
            each.stop()


class Driver:
    """`zocheck-ray train` of one run as a process of its own on this machine, or as a job submitted to the
    cluster (its lines then read from its driver's log on this machine)."""

    def __init__(self, cluster: JoinedCluster, run_id: str, storage: Path, label: str, job: bool = False):
        self.cluster, self.run_id, self.label = cluster, run_id, label
        self.summary = storage.parent / f"{label}.json"  # in the command line too: the job's process is found by it
        args = ["train", *TRAIN_ARGS, "--storage", str(storage), "--set", f"run_id={run_id}", "--json",
                str(self.summary)]
        self.job = job
        self.held = False
        if self.job:
            self.submission = f"{label}-{uuid.uuid4().hex[:6]}"
            submitted = subprocess.run(
                [str(ENV_BIN / "ray"), "job", "submit", "--address", cluster.dashboard, "--submission-id",
                 self.submission, "--no-wait", "--working-dir", ".", "--runtime-env", "deploy/runtime_env.yaml",
                 "--", "python3", "-m", "zocheck_ray", *args],
                env=cluster.env, cwd=REPO, capture_output=True, text=True, timeout=120)
            assert submitted.returncode == 0, submitted.stdout + submitted.stderr
            self.log = Path(cluster.ray_tmp, "ray", "session_latest", "logs", f"job-driver-{self.submission}.log")
        else:
            self.process = subprocess.Popen([sys.executable, "-m", "zocheck_ray", *args, "--address", cluster.gcs],
                                            env=cluster.env, cwd=REPO, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)
            self.output = DriverOutput(self.process)

    def lines(self) -> list[str]:
        if not self.job:
            return list(self.output.lines)
        return self.log.read_text(errors="replace").splitlines() if self.log.exists() else []

    def started(self) -> bool:
        """Whether it printed its run's start line (its shadow and trainers are up)."""
        return any(line.startswith(f"run {self.run_id}: ") for line in self.lines())

    def ended(self) -> bool:
        return self._state() is not None

    def _state(self) -> int | str | None:
        if not self.job:
            return self.process.poll()
        with urllib.request.urlopen(f"{self.cluster.dashboard}/api/jobs/{self.submission}", timeout=60) as answer:
            state = json.load(answer)["status"]  # Ray's Jobs REST API
        return state if state in ("SUCCEEDED", "FAILED", "STOPPED") else None

    def wait_for_end(self) -> tuple[int | str, list[str]]:
        """(its exit status, or the job's end state, SUCCEEDED or FAILED; its lines)."""
        assert wait_until(self.ended, timeout=BOUND_SECONDS), f"{self.label} did not end:\n" + "\n".join(self.lines())
        if not self.job:
            return self.process.returncode, self.output.wait_for_end()
        return self._state(), self.lines()

    def _processes(self) -> list[int]:
        return [self.process.pid] if not self.job else processes_naming(str(self.summary))

    def hold(self) -> None:
        """Stop its process where it is (SIGSTOP): its run holds its actors and its claim meanwhile."""
        pids = self._processes()
        assert pids, f"no process of {self.label}"
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        self.held = True

    def let_go(self) -> None:
        for pid in self._processes():
            os.kill(pid, signal.SIGCONT)
        self.held = False

    def close(self) -> None:
        """Whatever still runs of it goes (a failed test's)."""
        if self.held:
            self.let_go()
        if not self.job:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        elif not self.ended():
            subprocess.run([str(ENV_BIN / "ray"), "job", "stop", "--address", self.cluster.dashboard,
                            self.submission], env=self.cluster.env, capture_output=True, timeout=120)


def assert_refused(driver: Driver) -> str:
    """The driver ended refused, its refusal in one line naming the run, its holder and what to do; returns it."""
    state, lines = driver.wait_for_end()
    text = "\n".join(lines)
    assert state in (2, "FAILED"), f"{driver.label} ({state}):\n{text}"
    assert "Traceback" not in text and not re.search(r"^\[.*\] E |\bERROR\b", text, re.M), text
    said = [line for line in lines if line.startswith("zocheck-ray train: ")]
    assert len(said) == 1 and re.match(REFUSED.format(run_id=re.escape(driver.run_id)), said[0]), text
    assert not driver.summary.exists()  # it ran nothing
    return said[0]


def assert_verified(driver: Driver) -> dict:
    """The driver's run ended exact and verified, with no restart or recovery: nothing of it was touched."""
    state, lines = driver.wait_for_end()
    text = "\n".join(lines)
    assert state in (0, "SUCCEEDED") and lines[-2] == "verified", f"{driver.label} ({state}):\n{text}"
    assert re.search(r"^  shadow == trainer +yes, bit for bit$", text, re.M), text
    summary = json.loads(driver.summary.read_text())
    assert summary["steps"] == STEPS and summary["verification"]["verified"]
    assert summary["recoveries"] == [] and summary["shadow_restarts"] == 0
    return summary


def join_run_and_refuse(clusters, kind: str, tmp_path: Path) -> None:
    """The case of this module's docstring on the cluster of `kind` (`ray job submit`: as jobs)."""
    cluster, job = clusters(kind), kind == "ray job submit"
    storage = tmp_path / "runs"
    run_id = f"out-{uuid.uuid4().hex[:6]}"
    drivers = []
    try:
        # two jobs of one run started together: one claims the run, the other is refused
        drivers += [Driver(cluster, run_id, storage, "first", job), Driver(cluster, run_id, storage, "together", job)]
        assert wait_until(lambda: any(d.started() for d in drivers) or all(d.ended() for d in drivers),
                          timeout=BOUND_SECONDS)
        running = [d for d in drivers if d.started()]
        assert len(running) == 1, "\n\n".join("\n".join(d.lines()) for d in drivers)
        (winner,) = running
        winner.hold()  # it holds the run while a third job starts and ends
        (loser,) = [d for d in drivers if d is not winner]
        assert_refused(loser)

        # a job of the run started while it runs: refused before anything of it starts; `status` reads the run
        drivers.append(Driver(cluster, run_id, storage, "after", job))
        status = subprocess.run([sys.executable, "-m", "zocheck_ray", "status", run_id, "--address", cluster.gcs,
                                 "--json"], env=cluster.env, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["run_id"] == run_id
        assert_refused(drivers[-1])

        winner.let_go()
        assert_verified(winner)
    finally:
        for driver in drivers:
            driver.close()


@pytest.mark.parametrize("kind", ["ray start --head", "Cluster of two nodes"])
def test_a_driver_joins_the_cluster_runs_verified_and_other_jobs_of_its_run_are_refused(clusters, kind, tmp_path):
    join_run_and_refuse(clusters, kind, tmp_path)
