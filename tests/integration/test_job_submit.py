"""`ray job submit` against a cluster started with `ray start --head`, as the README shows it.

The head node is this test module's own: its own temp dir and ports, and in teardown only
the processes whose command line names that temp dir are stopped (never a blanket
`ray stop`, which would stop every Ray instance of this user on the machine). It is started
the way the README asks: `ray start --head` from the activated environment, whose `python3`
the documented entrypoint, `python3 -m zocheck_ray ...`, then finds; `--working-dir .` ships
the code. An entrypoint whose Python lacks the dependencies fails with one line that says
what to do.

One job, long enough that it cannot end before the test stops it (so `zocheck-ray status`
is read while it runs, whatever the machine's speed), is stopped with `ray job stop` as a
user or a scheduler stops one: its SIGTERM stops the run at a step boundary, durable, and the
durable state is then verified from storage alone. The head is started with the stop grace
that docs/running.md asks for (`RAY_JOB_STOP_WAIT_TIME_S`; Ray's default of 3 s may kill the
driver before its state is durable). A run that ends by itself and prints its summary is
`train`'s own test (test_train_cli.py). The test waits on states only.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from conftest import CLUSTER_ENV, free_ports, stop_processes_naming
from support import REPO

pytestmark = pytest.mark.slow  # a `ray start --head` node and a submitted job

ENV_BIN = Path(sys.executable).parent
ENTRYPOINT = ["python3", "-m", "zocheck_ray"]  # as the README writes it
ENDLESS_STEPS = 10**7  # a job that only ends when stopped: the test reads its status while it runs
JOB_ARGS = ["--set", "task.batch_size=4", "--set", "task.max_length=32", "--set", "task.eval_interval=10",
            "--set", "shadow.snapshot_interval=5", "--set", "log_interval=5"]
ENDED = ("SUCCEEDED", "FAILED", "STOPPED")
STOP_GRACE_SECONDS = 120
"""How long `ray job stop` waits after its SIGTERM before SIGKILL (Ray's default: 3 s)."""


@pytest.fixture(scope="module")
def head():
    temp_dir = tempfile.mkdtemp(prefix="zjs", dir="/tmp")  # short: Ray's socket paths are length-limited
    # the environment activated (its bin first on PATH), as the README starts the cluster; token authentication
    # with a token of this cluster's own (Ray 2.60 enables it by default)
    env = {**os.environ, "PATH": os.pathsep.join([str(ENV_BIN), "/usr/local/bin", "/usr/bin", "/bin"]),
           "VIRTUAL_ENV": str(ENV_BIN.parent), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": "", "RAY_JOB_STOP_WAIT_TIME_S": str(STOP_GRACE_SECONDS),
           CLUSTER_ENV: temp_dir}
    env.pop("RAY_ADDRESS", None)
    flags = ["--port", "--dashboard-port", "--ray-client-server-port", "--node-manager-port", "--object-manager-port",
             "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
             "--runtime-env-agent-port"]
    ports = dict(zip(flags, free_ports(len(flags))))  # distinct: Ray refuses one port for two components
    gcs, dashboard = ports["--port"], ports["--dashboard-port"]
    start = [str(ENV_BIN / "ray"), "start", "--head", f"--temp-dir={temp_dir}", "--num-cpus=4", "--num-gpus=0",
             "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--disable-usage-stats",
             *[f"{k}={v}" for k, v in ports.items()]]
    try:
        subprocess.run(start, env=env, check=True, capture_output=True, text=True, timeout=120)
        yield {"env": env, "gcs": f"127.0.0.1:{gcs}", "dashboard": f"http://127.0.0.1:{dashboard}",
               "temp_dir": temp_dir}
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"ray start --head failed:\n{exc.stdout}\n{exc.stderr}")
    finally:
        stop_processes_naming(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def ray_cli(head, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(ENV_BIN / "ray"), *args], env=head["env"], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def zocheck_ray_cli(head, *args: str) -> subprocess.CompletedProcess:
    """`python -m zocheck_ray ...` from another process on the head node, with this checkout importable."""
    env = {**head["env"], "PYTHONPATH": str(REPO)}
    # `status` waits at most its --timeout (30 s) for the shadow, then says which actor did not answer; the
    # ceiling here only bounds a hang of the whole command (start-up and connection included) on a loaded machine
    return subprocess.run([sys.executable, "-m", "zocheck_ray", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def job_status(head, submission_id: str) -> str:
    out = ray_cli(head, "job", "status", "--address", head["dashboard"], submission_id)
    text = out.stdout + out.stderr
    running = re.search(rf"Status for job '{re.escape(submission_id)}': (\w+)", text)
    ended = re.search(rf"Job '{re.escape(submission_id)}' (?:was )?(succeeded|failed|stopped)", text)
    assert running or ended, f"no job status in:\n{text}"
    return running.group(1) if running else ended.group(1).upper()


def job_logs(head, submission_id: str) -> str:
    return ray_cli(head, "job", "logs", "--address", head["dashboard"], submission_id).stdout


def wait_for_job_line(head, submission_id: str, pattern: str, after: int = -1) -> re.Match:
    """The first line of the running job's output that matches `pattern` (and, where it names a step, of a step
    after `after`), read from its driver's log file on this head node; fails once the job has ended without
    one (asked every few polls: `ray job status` is a process of its own)."""
    log = Path(head["temp_dir"]) / "session_latest" / "logs" / f"job-driver-{submission_id}.log"
    deadline = time.monotonic() + 300  # a ceiling for a loaded machine, not a timing
    for poll in itertools.count():
        text = log.read_text(errors="replace") if log.exists() else ""
        for found in re.finditer(pattern, text, re.MULTILINE):
            step = re.match(r"  step +(\d+)", found.group(0))
            if step is None or int(step.group(1)) > after:
                return found
        if poll % 10 == 9:
            state = job_status(head, submission_id)
            assert state in ("PENDING", "RUNNING"), f"the job ended ({state}) though only a stop ends it:\n{text}"
        assert time.monotonic() < deadline, f"no line of the job matches {pattern!r}:\n{text}"
        time.sleep(0.5)


def submit(head, run_id: str, steps: int, storage: Path, entrypoint: list[str] = ENTRYPOINT) -> str:
    """The README's `ray job submit` command (fewer steps, a smaller batch), without waiting."""
    submission_id = f"zocheck-{run_id}"
    submitted = ray_cli(
        head, "job", "submit", "--address", head["dashboard"], "--submission-id", submission_id, "--no-wait",
        "--working-dir", ".", "--runtime-env", "deploy/runtime_env.yaml",
        "--", *entrypoint, "train", "--config", "deploy/examples/sst2-opt.yaml",
        "--steps", str(steps), "--storage", str(storage), "--set", f"run_id={run_id}", *JOB_ARGS,
    )
    assert submitted.returncode == 0, submitted.stderr
    assert "submitted successfully" in submitted.stdout + submitted.stderr
    return submission_id


def wait_until_ended(head, submission_id: str, ceiling: float = 300) -> str:
    """The job's final state; `ceiling` only bounds a hung job on a loaded machine, it is not a timing."""
    deadline = time.monotonic() + ceiling
    while (state := job_status(head, submission_id)) not in ENDED and time.monotonic() < deadline:
        time.sleep(1)
    return state


@pytest.mark.ray_range
def test_a_submitted_job_reports_status_while_it_runs_and_ray_job_stop_leaves_it_durable(head, tmp_path):
    from zocheck_ray.cli import main

    run_id = f"endless-{uuid.uuid4().hex[:6]}"
    storage = tmp_path / "runs"
    job = submit(head, run_id, ENDLESS_STEPS, storage)

    # While it runs: `zocheck-ray status RUN_ID` from another process reads its shadow's metrics, once the job's
    # progress says a step is durable (each `status` and `ray job status` is a process of its own)
    wait_for_job_line(head, job, r"^  step +\d+ .* durable +[1-9]\d*\b")
    for _ in range(10):  # a rank's seconds per step come with the trainer's next report
        out = zocheck_ray_cli(head, "status", run_id, "--address", head["gcs"], "--json")
        assert out.returncode == 0, out.stderr[-3000:]
        status = json.loads(out.stdout)
        if status["rank_seconds_per_step"]:
            break
        wait_for_job_line(head, job, r"^  step +\d+ ", after=status["trainer_step"])
    assert status["run_id"] == run_id
    assert status["trainer_step"] > 0 and status["durable_step"] > 0, status
    assert status["replayed_step"] <= status["received_step"] <= status["trainer_step"]
    assert len(status["rank_seconds_per_step"]) == 1 and status["rank_seconds_per_step"][0] > 0, status

    stopped = ray_cli(head, "job", "stop", "--address", head["dashboard"], job)  # waits for the job to end
    assert stopped.returncode == 0, stopped.stderr
    assert wait_until_ended(head, job) == "STOPPED"
    logs = job_logs(head, job)
    assert re.search(r"step\s+\d+\s+loss", logs), logs  # its progress lines reached the job's logs
    # the SIGTERM stopped it at a step boundary with its state durable, where --storage said
    said = re.search(r"stopped by SIGTERM at step (\d+): its state is durable in (\S+); the run's lease is released",
                     logs)
    assert said, logs
    assert said.group(2) == str(storage / run_id)
    assert int(said.group(1)) >= status["trainer_step"]
    assert main(["verify", said.group(2)]) == 0  # the durable state is whole and replays to its hashes


def test_status_of_an_unknown_run_is_a_clear_error(head):
    out = zocheck_ray_cli(head, "status", "no-such-run", "--address", head["gcs"])
    assert out.returncode == 2
    assert "no running shadow for run 'no-such-run'" in out.stderr


def test_an_entrypoint_whose_python_lacks_the_dependencies_fails_with_one_line_that_says_what_to_do(head, tmp_path):
    import venv

    venv.create(tmp_path / "bare", with_pip=False)  # the standard library only, as a system `python3` may be
    bare = str(tmp_path / "bare" / "bin" / "python")
    job = submit(head, f"bare-{uuid.uuid4().hex[:6]}", 10, tmp_path / "runs", entrypoint=[bare, "-m", "zocheck_ray"])
    assert wait_until_ended(head, job) == "FAILED"
    logs = job_logs(head, job)
    assert "Traceback" not in logs, logs
    (line,) = [line for line in logs.splitlines() if line.startswith("zocheck-ray: ")]
    assert line.startswith(f"zocheck-ray: {bare} lacks 'torch'")
    assert "start the cluster from the activated environment" in line
