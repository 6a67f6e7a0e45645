"""`ray job submit` against a cluster started with `ray start --head`, as the README shows it.

The head node is this test module's own: its own temp dir and ports, and in teardown only
the processes whose command line names that temp dir are stopped (never a blanket
`ray stop`, which would stop every Ray instance of this user on the machine). The cluster
runs in this test's Python environment, where zocheck-ray's dependencies are installed, so
the runtime env installs nothing; `--working-dir .` ships the code itself.
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
import time
import uuid
from pathlib import Path

import pytest

from conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
STEPS = 30


def our_processes(marker: str) -> list[int]:
    """Processes whose command line names `marker` (this cluster's temp dir)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(name))
        except OSError:
            pass
    return found


def stop_cluster(temp_dir: str) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        for pid in our_processes(temp_dir):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while our_processes(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.1)


def command_path(bin_dir: Path) -> str:
    """A PATH on which `zocheck-ray` and `ray` run in this Python environment.

    Where the package is installed (`pip install -e .`, as `make` does), its console script
    is used; otherwise one equivalent to it is written to `bin_dir`.
    """
    env_bin = Path(sys.executable).parent
    if not (env_bin / "zocheck-ray").exists():
        bin_dir.mkdir(exist_ok=True)
        script = bin_dir / "zocheck-ray"
        script.write_text(f"#!{sys.executable}\nimport sys\nfrom zocheck_ray.cli import main\nsys.exit(main())\n")
        script.chmod(0o755)
    return os.pathsep.join([str(bin_dir), str(env_bin), os.environ.get("PATH", "")])


@pytest.fixture(scope="module")
def head():
    temp_dir = tempfile.mkdtemp(prefix="zjs", dir="/tmp")  # short: Ray's socket paths are length-limited
    # token authentication with a token of this cluster's own (Ray 2.60 enables it by default)
    env = {**os.environ, "PATH": command_path(Path(temp_dir) / "bin"), "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": ""}
    env.pop("RAY_ADDRESS", None)
    gcs, dashboard = free_port(), free_port()
    ports = {"--port": gcs, "--dashboard-port": dashboard, "--ray-client-server-port": free_port(),
             "--node-manager-port": free_port(), "--object-manager-port": free_port(),
             "--dashboard-agent-listen-port": free_port(), "--dashboard-agent-grpc-port": free_port(),
             "--metrics-export-port": free_port(), "--runtime-env-agent-port": free_port()}
    start = ["ray", "start", "--head", f"--temp-dir={temp_dir}", "--num-cpus=4", "--num-gpus=0",
             "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--disable-usage-stats",
             *[f"{k}={v}" for k, v in ports.items()]]
    try:
        subprocess.run(start, env=env, check=True, capture_output=True, text=True, timeout=120)
        yield {"env": env, "gcs": f"127.0.0.1:{gcs}", "dashboard": f"http://127.0.0.1:{dashboard}",
               "temp_dir": temp_dir}
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"ray start --head failed:\n{exc.stdout}\n{exc.stderr}")
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def ray_cli(head, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["ray", *args], env=head["env"], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def zocheck_ray_cli(head, *args: str) -> subprocess.CompletedProcess:
    """`zocheck-ray ...` from another process on the head node, with this checkout importable."""
    env = {**head["env"], "PYTHONPATH": str(ROOT)}
    return subprocess.run(["zocheck-ray", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


def job_status(head, submission_id: str) -> str:
    out = ray_cli(head, "job", "status", "--address", head["dashboard"], submission_id)
    text = out.stdout + out.stderr
    running = re.search(rf"Status for job '{re.escape(submission_id)}': (\w+)", text)
    ended = re.search(rf"Job '{re.escape(submission_id)}' (succeeded|failed|stopped)", text)
    assert running or ended, f"no job status in:\n{text}"
    return running.group(1) if running else ended.group(1).upper()


def test_submitted_job_runs_reports_status_and_prints_its_summary(head, tmp_path):
    run_id = f"submit-{uuid.uuid4().hex[:6]}"
    submission_id = f"zocheck-{run_id}"
    submitted = ray_cli(
        head, "job", "submit", "--address", head["dashboard"], "--submission-id", submission_id, "--no-wait",
        "--working-dir", ".", "--runtime-env", "deploy/runtime_env.yaml",
        "--", "zocheck-ray", "train", "--config", "deploy/examples/sst2-opt.yaml",
        "--steps", str(STEPS), "--storage", str(tmp_path / "runs"), "--set", f"run_id={run_id}",
        "--set", "task.batch_size=4", "--set", "task.max_length=32", "--set", "task.eval_interval=10",
        "--set", "snapshot_interval=5", "--set", "log_interval=5",
    )
    assert submitted.returncode == 0, submitted.stderr
    assert "submitted successfully" in submitted.stdout + submitted.stderr

    # While it runs: `zocheck-ray status RUN_ID` from another process reads the shadow's metrics.
    status = None
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        state = job_status(head, submission_id)
        assert state in ("PENDING", "RUNNING"), f"the job ended ({state}) before its status could be read:\n" + \
            ray_cli(head, "job", "logs", "--address", head["dashboard"], submission_id).stdout
        out = zocheck_ray_cli(head, "status", run_id, "--address", head["gcs"], "--json")
        if out.returncode == 0:
            status = json.loads(out.stdout)
            if status["trainer_step"] > 0:
                break
        time.sleep(0.5)
    assert status is not None, (f"zocheck-ray status never found the running job:\n{out.stderr[-3000:]}\njob logs:\n"
                                + ray_cli(head, "job", "logs", "--address", head["dashboard"], submission_id).stdout)
    assert status["run_id"] == run_id
    assert 0 < status["trainer_step"] <= STEPS
    assert status["replayed_step"] <= status["received_step"] <= status["trainer_step"]

    deadline = time.monotonic() + 300  # a ceiling for a loaded machine, not a timing
    while (state := job_status(head, submission_id)) in ("PENDING", "RUNNING") and time.monotonic() < deadline:
        time.sleep(2)
    logs = ray_cli(head, "job", "logs", "--address", head["dashboard"], submission_id).stdout
    assert state == "SUCCEEDED", logs
    # the summary table, its exactness line, and durable state where --storage said
    assert f"run {run_id}:" in logs
    assert "final state_hash" in logs
    assert "yes, bit for bit" in logs
    assert (tmp_path / "runs" / run_id / "snapshots").is_dir()


def test_status_of_an_unknown_run_is_a_clear_error(head):
    out = zocheck_ray_cli(head, "status", "no-such-run", "--address", head["gcs"])
    assert out.returncode == 2
    assert "no running shadow for run 'no-such-run'" in out.stderr
