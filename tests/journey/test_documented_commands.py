"""The documented commands work as written (issue 65, item 5): every command block of README.md and docs/*.md runs,
as written, from a clone of this checkout on two cores (with fewer steps only through a documented flag, named in
`COMMANDS`), or, where it needs what this machine lacks (a Kubernetes cluster, a cloud account, a GPU, an hour), is
checked as far as it can be. `COMMANDS` (tests/documented.py) says which command runs where and how;
tests/unit/test_documented_table.py holds it to the documents, so a new block needs a row.

The clone is this checkout's files as `git ls-files` lists them (tracked, and new files that are not ignored),
copied with their times, less the package itself: every command imports the package the environment installed
from this checkout, as `make venv` installs a fresh clone's (and numba's compiled kernels stay those `make test`
compiled). Its `.venv` is this checkout's environment, set up by `make test` before this runs in CI (.ci/run).
Commands run in the clone through bash, with the environment's `bin/` first on PATH, a home of their own (holding
a Ray token, as after a local `ray.init()`) and a Ray temp dir of their own; at the end every process naming
that temp dir is stopped. Every wait is on a line printed or a process that ended; a ceiling bounds a hang.

`make test-docs` runs this module (.ci/run calls it after `make test`, which leaves it out).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import CLUSTER_ENV, free_ports, stop_processes_naming
from documented import INLINE, block, command
from support import REPO, stop_driver

BOUND_SECONDS = 900  # a ceiling for a loaded machine, not a timing


# ------------------------------------------------------------------------------------------- the clone


class Clone:
    """The clone, its environment and what its commands left running."""

    def __init__(self, root: Path):
        self.root = root
        self.ray_tmp = tempfile.mkdtemp(prefix="zjd", dir="/tmp")  # short: Ray's socket paths are length-limited
        home = root.parent / "home"
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))  # as after a local ray.init()
        env = {k: v for k, v in os.environ.items()  # not make test-docs's make variables either
               if not k.startswith(("RAY_", "AWS_", "PYTEST", "VIRTUAL_ENV", "MAKE", "MFLAGS"))}
        venv = root / ".venv"
        self.env = {**env, "PATH": os.pathsep.join([str(venv / "bin"), "/usr/local/bin", "/usr/bin", "/bin"]),
                    "VIRTUAL_ENV": str(venv), "HOME": str(home), "PYTHONPATH": "",
                    "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache"),
                    "RAY_TMPDIR": self.ray_tmp, "TMPDIR": self.ray_tmp, "RAY_USAGE_STATS_ENABLED": "0",
                    CLUSTER_ENV: self.ray_tmp}
        self.started: list[subprocess.Popen] = []

    def run(self, command: str, timeout: float = BOUND_SECONDS, env: dict | None = None,
            ) -> subprocess.CompletedProcess:
        """`command` through bash in the clone; its output (stdout and stderr together) as `stdout`."""
        return subprocess.run(["bash", "-c", command], cwd=self.root, env={**self.env, **(env or {})}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)

    def start(self, command: str, log: str, env: dict | None = None) -> Running:
        """`command` through bash in the background (`exec` it to have its own pid), its output into `log` beside
        the clone (a file growing in it would change what `ray job submit --working-dir .` uploads meanwhile)."""
        out = open(self.root.parent / log, "w")
        process = subprocess.Popen(["bash", "-c", command], cwd=self.root, env={**self.env, **(env or {})},
                                   stdout=out, stderr=subprocess.STDOUT, text=True)
        out.close()
        self.started.append(process)
        return Running(process, self.root.parent / log)

    def python(self, code: str, name: str, env: dict | None = None) -> subprocess.CompletedProcess:
        """A documented Python block, as a script of the clone's."""
        (self.root / name).write_text(code)
        return self.run(f"python {name}", env=env)

    def close(self) -> None:
        for process in self.started:
            stop_driver(process)
        stop_processes_naming(self.ray_tmp)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


@dataclass
class Running:
    process: subprocess.Popen
    log: Path

    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()

    def wait_for(self, pattern: str, after: int = 0) -> tuple[int, re.Match]:
        """The first line from index `after` on that `pattern` matches from its start: (index, match)."""
        deadline = time.monotonic() + BOUND_SECONDS
        while True:
            lines = self.lines()
            for i in range(after, len(lines)):
                if (match := re.match(pattern, lines[i])) is not None:
                    return i, match
            assert self.process.poll() is None and time.monotonic() < deadline, \
                f"no line matches {pattern!r}:\n" + "\n".join(lines)
            time.sleep(0.2)

    def wait(self) -> tuple[int, list[str]]:
        return self.process.wait(timeout=BOUND_SECONDS), self.lines()


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    root = tmp_path_factory.mktemp("journey") / "zocheck-ray"
    listed = subprocess.run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=REPO, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if rel.startswith("zocheck_ray/") or not (REPO / rel).is_file():
            continue  # the package: the environment's (see the module docstring); a file deleted meanwhile
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, root / rel)
    venv = root / ".venv"  # this checkout's environment, set up (make venv's stamps written after its inputs)
    venv.mkdir()
    for entry in (REPO / ".venv").iterdir():
        if not entry.name.startswith("."):
            (venv / entry.name).symlink_to(entry)
    (venv / ".installed").touch()
    (venv / ".bytecode").touch()
    made = Clone(root)
    try:
        yield made
    finally:
        made.close()


def ended_well(result: subprocess.CompletedProcess | tuple[int, list[str]], code: int = 0) -> str:
    rc, text = (result.returncode, result.stdout) if isinstance(result, subprocess.CompletedProcess) else \
        (result[0], "\n".join(result[1]))
    assert rc == code and "Traceback" not in text, f"exit {rc}:\n{text[-6000:]}"
    return text


def table(text: str) -> dict[str, str]:
    """The final table's rows of `train`'s output."""
    rows = {}
    for line in text.split("\n\n")[-1].splitlines():
        if line.startswith("  ") and "  " in line.strip():
            key, value = line.strip().split("  ", 1)
            rows[key.strip()] = value.strip()
    return rows


# ------------------------------------------------------------------------------------------- local instances


def test_make_demo_prints_what_the_readme_shows(clone):
    assert command("README.md", "make demo") == "make demo"
    text = ended_well(clone.run("make demo"))
    lines = text.splitlines()
    assert lines[-1] == "verified"
    sample = block("README.md", "$ make demo").text.splitlines()
    for prefix in ("  ray: a local instance for this run at ", "run run-", "  task lm: 384 training rows, 96 held-out "
                   "rows (loss), batch 16, byte-level (vocab 128)", "  profile (", "  step    25  loss ",
                   "  injected failure at step 180: the trainer process exits",
                   "  trainer lost at step 180 (software); Ray restarted its process; recovered at step "):
        assert any(line.startswith(prefix) for line in sample), prefix  # the README shows it
        assert any(line.startswith(prefix) for line in lines), f"{prefix!r} not in:\n{text}"
    assert list(table(text)) == list(table("\n".join(sample[:-1])))  # the same rows, in the same order
    assert table(text)["shadow == trainer"] == "yes, bit for bit"


def test_train_recover_and_verify_as_the_readme_shows(clone):
    from transformers import AutoModelForCausalLM

    from zocheck_ray.core import state_hash
    from zocheck_ray.workload.models import trainable_parameters

    train = command("README.md", "zocheck-ray train --steps 200")
    assert train == "zocheck-ray train --steps 200 --storage ./runs --fail-at 80 --json summary.json"
    text = ended_well(clone.run(train))
    assert text.splitlines()[-2:] == ["verified", "wrote summary.json"], text
    summary = json.loads((clone.root / "summary.json").read_text())
    assert summary["steps"] == 200 and [r["failed_at_step"] for r in summary["recoveries"]] == [80]
    run_id = summary["run_id"]

    recover = command("README.md", "zocheck-ray recover --storage ./runs/RUN_ID").replace("RUN_ID", run_id)
    text = ended_well(clone.run(recover))
    digest = re.search(r"^state_hash: (\w+)$", text, re.M).group(1)
    assert digest == summary["final_state_hash"] and "wrote: recovered/" in text
    model = AutoModelForCausalLM.from_pretrained(clone.root / "recovered", local_files_only=True)
    assert state_hash({name: p.detach() for name, p in trainable_parameters(model)}) == digest

    text = ended_well(clone.run(f"zocheck-ray verify ./runs/{run_id}"))  # the README's Commands table
    assert "proven" in text, text


def test_status_and_sigterm_of_a_running_train(clone):
    train = command("README.md", "zocheck-ray train --steps 200").replace("--steps 200", "--steps 100000")
    driver = clone.start(f"exec {train.replace(' --json summary.json', ' --json endless.json')}", "endless.log")
    _, started = driver.wait_for(r"run (run-\w+): ")
    run_id = started.group(1)
    driver.wait_for(r"  step +\d+ ")

    status = command("README.md", "zocheck-ray status RUN_ID --json").replace("RUN_ID", run_id)
    out = clone.run(status)
    assert out.returncode == 0, out.stdout
    doc = json.loads(out.stdout[out.stdout.index("{"):])
    assert (doc["run_id"], doc["state"]) == (run_id, "running") and doc["trainer_step"] > 0

    kill = command("README.md", "kill -TERM DRIVER_PID").replace("DRIVER_PID", str(driver.process.pid))
    assert clone.run(kill).returncode == 0
    code, lines = driver.wait()
    assert code == 143, "\n".join(lines)
    assert re.match(rf"  stopped by SIGTERM at step \d+: its state is durable in \S+/{run_id}; the run's lease is "
                    "released; run the same job again to resume it$", lines[-1]), "\n".join(lines)


def test_using_the_core(clone):
    code = block("README.md", "from zocheck_ray import ZOConfig").text
    reader = textwrap.dedent("""\
        import torch
        from zocheck_ray.workload import build_model

        model = build_model("tiny-opt")  # the reader's model, loader and seed
        run_seed = 7
        ids = torch.arange(2, 34).reshape(2, 16) % 128
        loader = [{"input_ids": ids, "labels": ids}] * 4
        """)
    out = clone.python(reader + code + "print('bit for bit')\n", "core.py")
    assert ended_well(out).splitlines()[-1] == "bit for bit"


def test_run_from_python_on_s3(clone):
    import logging

    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    (port,) = free_ports(1)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    aws = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    try:
        s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=aws["AWS_ENDPOINT_URL"], key="testing",
                          secret="testing").mkdir("bucket")
        code = block("README.md", "summary = zocheck_ray.run(").text
        (planned,) = [line for line in code.splitlines() if line.startswith("# zocheck_ray.run(job")]
        job = re.search(r"zocheck_ray\.run\((zocheck_ray\.JobConfig\(.*?\))\)\n", code, re.S).group(1)
        script = (code + f"print('exact', summary.steps)\njob = {job}\nfailed = {planned[2:]}\n"
                  "print('exact', failed.steps, [r.mode for r in failed.recoveries], "
                  "failed.final_state_hash == failed.shadow_state_hash)\n")
        lines = ended_well(clone.python(script, "on_s3.py", env=aws)).splitlines()
        assert "exact 200" in lines and "exact 200 ['software', 'host'] True" in lines, "\n".join(lines)
    finally:
        server.stop()


def test_the_sft_job_file_fails_recovers_and_verifies(clone):
    job = command("docs/sft.md", "zocheck-ray train --config deploy/examples/sft-chat-lora.yaml")
    assert job == INLINE[0].marker  # the README's is the same command
    text = ended_well(clone.run(job))
    assert text.splitlines()[-1] == "verified"
    assert re.search(r"^  rank 0 lost at step 20|^  trainer lost at step 20 \(software\)", text, re.M), text


def test_the_tune_command_on_two_cores(clone):
    tune = command("docs/tune.md", "zocheck-ray tune --config deploy/examples/sst2-opt.yaml")
    text = ended_well(clone.run(f"{tune} --num-cpus 3 --steps 10"))
    rows = [line for line in text.splitlines() if re.match(r"  (0\.003|0\.01) ", line)]
    assert len(rows) == 4 and all(" True " in row for row in rows), text  # every trial exact


def test_the_tune_sweep_from_python(clone):
    code = block("docs/tune.md", "results = sweep(").text
    script = ("import ray\nray.init(num_cpus=3)  # docs/tune.md: a two-core machine's local instance, 3 CPUs\n"
              + code + "print('trials', [(r.error, r.metrics.get('exact')) for r in results])\n")
    lines = ended_well(clone.python(script, "sweep.py")).splitlines()
    assert lines[-1] == "trials [(None, True), (None, True)]", "\n".join(lines[-40:])


def test_the_benchmark_suite_runs_quick(clone):
    (only,) = [line.split("  #")[0].strip() for line in block("docs/benchmarks.md", "--only waste").text.splitlines()
               if "--only waste scaling memory" in line]
    ended_well(clone.run(f"{only} --quick"))
    assert (clone.root / "benchmarks" / "results" / "summary.md").is_file()


# ------------------------------------------------------------------------------------------- a `ray start` head


@pytest.fixture(scope="module")
def head(clone):
    """The `ray start --head` of docs/running.md, with a Ray temp dir, ports and 4 logical CPUs of its own; its
    environment records it as this machine's `ray start` cluster (Ray looks in `<RAY_TMPDIR>/ray`)."""
    ray_tmp = tempfile.mkdtemp(prefix="zjh", dir="/tmp")
    flags = ["--port", "--dashboard-port", "--ray-client-server-port", "--node-manager-port", "--object-manager-port",
             "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
             "--runtime-env-agent-port"]
    ports = dict(zip(flags, free_ports(len(flags))))
    env = {"RAY_TMPDIR": ray_tmp, "TMPDIR": ray_tmp, CLUSTER_ENV: ray_tmp}
    start = command("docs/running.md", "RAY_JOB_STOP_WAIT_TIME_S=120 ray start --head")
    flags = (f" --temp-dir={ray_tmp}/ray --num-cpus=4 --num-gpus=0 --dashboard-host=127.0.0.1 --disable-usage-stats "
             + " ".join(f"{k}={v}" for k, v in ports.items()))
    try:
        ended_well(clone.run(start + flags, env=env))
        yield {"env": env, "dashboard": f"http://127.0.0.1:{ports['--dashboard-port']}", "ray_tmp": ray_tmp}
    finally:
        stop_processes_naming(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_ray_job_submit_as_documented(clone, head):
    mode = command("docs/running.md", "export RAY_AUTH_MODE=token")
    jobs = {**head["env"], "RAY_ADDRESS": head["dashboard"]}  # the page: a dashboard on another port
    submit = clone.start(f"{mode} && exec {command('docs/running.md', 'ray job submit --working-dir .')}", "submit.log",
                         env=jobs)
    _, submitted = submit.wait_for(r".*Job '(raysubmit_\w+)' submitted successfully")
    submit.wait_for(r"  step +\d+ ")
    out = clone.run(command("docs/running.md", "zocheck-ray status sst2-1"), env=head["env"])
    assert out.returncode == 0 and re.search(r"^state +running$", out.stdout, re.M), out.stdout
    logs = command("docs/running.md", "ray job logs --follow JOB_ID").replace("JOB_ID", submitted.group(1))
    text = ended_well(clone.run(f"{mode} && {logs}", env=jobs))
    assert re.search(r"^  shadow == trainer +yes, bit for bit$", text, re.M), text
    ended_well(submit.wait())


def test_data_parallel_with_a_rank_lost_as_documented(clone, head):
    shutil.copy(clone.root / "deploy" / "examples" / "sst2-opt.yaml", clone.root / "job.yaml")
    text = ended_well(clone.run(f"{command('docs/data-parallel.md', 'zocheck-ray train --config job.yaml')} "
                                "--steps 60", env=head["env"]))
    assert "  ray: joined the cluster at " in text and text.splitlines()[-1] == "verified", text
    assert re.search(r"^  rank 1 lost at step 40 ", text, re.M), text


def test_tune_num_cpus_beside_a_ray_start_cluster_is_one_line(clone, head):
    tune = command("docs/tune.md", "zocheck-ray tune --config deploy/examples/sst2-opt.yaml")
    out = clone.run(f"{tune} --num-cpus 3", env=head["env"])
    assert out.returncode == 2 and len(out.stdout.strip().splitlines()) == 1, out.stdout
    assert out.stdout.startswith("zocheck-ray tune: --num-cpus sizes a local Ray instance, but this sweep joins the "
                                 "cluster at "), out.stdout
    assert out.stdout.rstrip().endswith("give that cluster's node the CPUs (ray stop, then ray start --head "
                                        "--num-cpus=3), or start a local instance for the sweep with "
                                        "RAY_ADDRESS=local"), out.stdout
    # the advice works: the same sweep on a local instance of its own, the cluster still running
    text = ended_well(clone.run(f"RAY_ADDRESS=local {tune} --num-cpus 3 --steps 10", env=head["env"]))
    rows = [line for line in text.splitlines() if re.match(r"  (0\.003|0\.01) ", line)]
    assert len(rows) == 4 and all(" True " in row for row in rows), text
