"""The documented commands work as written (issue 65, item 5): every command block of README.md and docs/*.md runs,
as written, from a clone of this checkout on two cores (with fewer steps only through a documented flag, named in
`COMMANDS`), or, where it needs what this machine lacks (a Kubernetes cluster, a cloud account, a GPU, an hour), is
checked as far as it can be. `COMMANDS` says which command runs where and how;
`test_every_block_of_the_docs_is_in_the_table` holds it to the documents, so a new block needs a row.

The clone is this checkout's files as `git ls-files` lists them (tracked, and new files that are not ignored),
copied with their times, less the package itself: every command imports the package the environment installed
from this checkout, as `make venv` installs a fresh clone's (and numba's compiled kernels stay those `make test`
compiled). Its `.venv` is this checkout's environment, set up by `make test` before this runs in CI (.ci/run).
Commands run in the clone through bash, with the environment's `bin/` first on PATH, a home of their own (holding
a Ray token, as after a local `ray.init()`) and a Ray temp dir of their own; at the end every process naming
that temp dir is stopped. Every wait is on a line printed or a process that ended; a ceiling bounds a hang.

`make test-docs` runs the commands (ZOCHECK_JOURNEY=1; .ci/run calls it after `make test`); in `make test` only
the table's own checks run.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import CLUSTER_ENV, free_ports, stop_processes_naming
from support import REPO

JOURNEY = os.environ.get("ZOCHECK_JOURNEY") == "1"
runs_commands = pytest.mark.skipif(not JOURNEY, reason="the documented commands run in `make test-docs` "
                                                       "(ZOCHECK_JOURNEY=1), after `make test`")
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BOUND_SECONDS = 900  # a ceiling for a loaded machine, not a timing


@dataclass(frozen=True)
class Command:
    """A command (or a block) of a document, where it runs and how."""

    doc: str
    marker: str
    """Text that only its block holds (a bash command: the command's start)."""
    where: str
    """`here: <test of this module>`, `<tests/...py>::<test>`, `checked: <test of this module>` or
    `not run: <why>`."""
    how: str = "as written"


COMMANDS = [
    Command("README.md", "make demo", "here: test_make_demo_prints_what_the_readme_shows",
            "as written: the embedded default job, 300 steps, on a local instance"),
    Command("README.md", "make test", "not run: .ci/run runs it before this module (make test-docs)"),
    Command("README.md", "driver: zocheck-ray train / zocheck_ray.run(job)", "not run: a diagram"),
    Command("README.md", "$ make demo", "checked: test_make_demo_prints_what_the_readme_shows",
            "make demo's output: its lines and its table's rows as the sample shows them"),
    Command("README.md", "# job.yaml: SST-2 style", "checked: test_the_yaml_blocks_validate",
            "validated as a job: its model directory and data are the reader's"),
    Command("README.md", "# MeZO's RTE task", "checked: test_the_yaml_blocks_validate",
            "validated as a job: its model directory and data are the reader's"),
    Command("README.md", "from zocheck_ray import ZOConfig", "here: test_using_the_core",
            "as written, with the names it leaves to the reader (model, loader, run_seed) defined first"),
    Command("README.md", "zocheck-ray train --steps 200", "here: test_train_recover_and_verify_as_the_readme_shows",
            "as written; then `zocheck-ray verify ./runs/RUN_ID` (the Commands table)"),
    Command("README.md", "zocheck-ray status RUN_ID --json", "here: test_status_and_sigterm_of_a_running_train",
            "while `zocheck-ray train --steps 100000 --storage ./runs --fail-at 80` runs (more steps: it must "
            "still run when status asks)"),
    Command("README.md", "kill -TERM DRIVER_PID", "here: test_status_and_sigterm_of_a_running_train",
            "as written, to that driver"),
    Command("README.md", "zocheck-ray recover --storage ./runs/RUN_ID",
            "here: test_train_recover_and_verify_as_the_readme_shows",
            "as written, on the run of `train --steps 200`; the directory loads with from_pretrained"),
    Command("README.md", "summary = zocheck_ray.run(", "here: test_run_from_python_on_s3",
            "as written, against an S3 endpoint on 127.0.0.1 (AWS_ENDPOINT_URL, bucket `bucket`); the commented "
            "FaultPlan run too, with `job` the same JobConfig"),
    Command("README.md", "from trl import SFTConfig, SFTTrainer",
            "tests/integration/test_zotrainer.py::test_the_readme_s_trl_and_zotrainer_examples_run_and_differ_in_ten_"
            "lines", "as written, on `my-model` and `chats.jsonl` saved there"),
    Command("README.md", "from zocheck_ray import ZOTrainer\n\ndataset = load_dataset",
            "tests/integration/test_zotrainer.py::test_the_readme_s_trl_and_zotrainer_examples_run_and_differ_in_ten_"
            "lines", "as written, on `my-model` and `chats.jsonl` saved there"),
    Command("README.md", "zocheck_ray/core/        Ray-free", "not run: the layout"),
    Command("docs/architecture.md", "trainer step t", "not run: a diagram"),
    Command("docs/benchmarks.md", "python -m benchmarks all --out benchmarks/results            # full sizes",
            "not run: full sizes take an hour or more on two cores; the same suite runs with --quick below"),
    Command("docs/benchmarks.md", "python -m benchmarks all --out benchmarks/results --quick",
            "here: test_the_benchmark_suite_runs_quick", "as written, into the clone's benchmarks/results"),
    Command("docs/benchmarks.md", "python -m benchmarks all --out benchmarks/results --only waste scaling memory",
            "here: test_the_benchmark_suite_runs_quick", "with --quick (their small sizes)"),
    Command("docs/data-parallel.md", "zocheck-ray train --config job.yaml --set scaling.trainers=2",
            "here: test_data_parallel_with_a_rank_lost_as_documented",
            "job.yaml: deploy/examples/sst2-opt.yaml copied; --steps 60; on a `ray start --head` node with 4 logical "
            "CPUs (two ranks and a shadow: more than a two-core machine's local instance has)"),
    Command("docs/quantized.md", "model: /models/llama-2-13b", "checked: test_the_yaml_blocks_validate",
            "validated as a job: its model directory is the reader's"),
    Command("docs/quantized.md", "state = load_qzo(base,",
            "not run: it needs a 13B model directory and a QZO run of it (tests/unit/test_quantized.py loads a small "
            "model's QZO snapshot with load_qzo)"),
    Command("docs/recovery.md", "perturb       for j", "not run: the operation sequences"),
    Command("docs/running.md", "ray_zocheck_shadow_lag_steps", "not run: a metric's sample"),
    Command("docs/running.md", "RAY_JOB_STOP_WAIT_TIME_S=120 ray start --head", "here: test_ray_job_submit_as_documented",
            "with a temp dir and free ports of its own, --num-cpus=4 and its dashboard's address in RAY_ADDRESS for "
            "the `ray job` commands (as the page says for a dashboard on another port)"),
    Command("docs/running.md", "export RAY_AUTH_MODE=token", "here: test_ray_job_submit_as_documented"),
    Command("docs/running.md", "ray job submit --working-dir .", "here: test_ray_job_submit_as_documented",
            "as written, the job's 300 steps"),
    Command("docs/running.md", "zocheck-ray status sst2-1", "here: test_ray_job_submit_as_documented",
            "while the job runs"),
    Command("docs/running.md", "ray job logs --follow JOB_ID", "here: test_ray_job_submit_as_documented",
            "with the job's id"),
    Command("docs/sft.md", "zocheck-ray train --config deploy/examples/sft-chat-lora.yaml",
            "here: test_the_sft_job_file_fails_recovers_and_verifies"),
    Command("docs/sft.md", "trainer = ZOTrainer(model=\"tiny-chat\"",
            "tests/integration/test_zotrainer.py::test_the_zotrainer_example_in_docs_sft_md_runs"),
    Command("docs/sft.md", "task = build_task(TaskConfig(kind=\"sft\"",
            "tests/unit/test_sft_task.py::test_the_example_in_docs_sft_md_runs"),
    Command("docs/storage.md", "storage: s3://my-bucket/zocheck-runs", "checked: test_the_yaml_blocks_validate"),
    Command("docs/tune.md", "zocheck-ray tune --config deploy/examples/sst2-opt.yaml",
            "here: test_the_tune_command_on_two_cores",
            "with --num-cpus 3 (the page's advice for a two-core machine) and --steps 10; beside a `ray start` "
            "cluster, --num-cpus is refused in one line, and its advice (RAY_ADDRESS=local) runs the sweep "
            "(test_tune_num_cpus_beside_a_ray_start_cluster_is_one_line)"),
    Command("docs/tune.md", "results = sweep(", "here: test_the_tune_sweep_from_python",
            "as written, after ray.init(num_cpus=3) (the page's advice for a two-core machine)"),
]

INLINE = [
    Command("README.md", "zocheck-ray train --config deploy/examples/sft-chat-lora.yaml --steps 40 --fail-at 20 "
                         "--verify", "here: test_the_sft_job_file_fails_recovers_and_verifies"),
    Command("docs/running.md", "KubeRay** (`deploy/kuberay/rayjob.yaml`, `kubectl apply -f`)",
            "checked: test_the_gpu_cluster_layouts_hold_together",
            "not run (no Kubernetes here): the RayJob parses and its entrypoint's job validates; "
            "tests/unit/test_deploy.py checks the rest"),
    Command("docs/running.md", "**`ray up`** (`deploy/cluster.yaml`, AWS)", "checked: test_the_gpu_cluster_layouts_hold_together",
            "not run (no cloud account, no GPU here): the cluster YAML parses and names its image; "
            "tests/unit/test_deploy.py checks the rest"),
]
"""Commands the documents write inside their text that a reader runs: where they run."""


# ------------------------------------------------------------------------------------------- the documents


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    lang: str
    text: str

    def commands(self) -> list[str]:
        """A bash block's commands: continuation lines joined, comments dropped."""
        joined = re.sub(r"\\\n\s*", " ", self.text)
        return [line.split("  #")[0].split(" # ")[0].strip() for line in joined.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]


def blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    return [Block(str(doc.relative_to(REPO)), text[:m.start()].count("\n") + 1, m.group(1), m.group(2))
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in blocks(doc)]


def block(doc: str, marker: str) -> Block:
    (found,) = [b for b in all_blocks() if b.doc == doc and marker in b.text]
    return found


def command(doc: str, start: str) -> str:
    """The documented command of `doc` that starts with `start`, as written."""
    (found,) = [c for b in all_blocks() if b.doc == doc and b.lang == "bash" for c in b.commands()
                if c.startswith(start)]
    return found


def test_every_block_of_the_docs_is_in_the_table():
    rows = [(c.doc, c.marker) for c in COMMANDS]
    assert len(set(rows)) == len(rows)
    for b in all_blocks():
        if b.lang == "yaml" or not b.lang or b.lang in ("bash", "python"):
            mine = [c for c in COMMANDS if c.doc == b.doc and c.marker in b.text]
            assert mine, f"{b.doc}:{b.line}: a {b.lang or 'plain'} block without a row in COMMANDS:\n{b.text}"
        if b.lang == "bash":
            for line in b.commands():
                assert any(c.doc == b.doc and line.startswith(c.marker) for c in COMMANDS), \
                    f"{b.doc}:{b.line}: `{line}` has no row in COMMANDS"
    for c in COMMANDS:
        matched = [b for b in all_blocks() if b.doc == c.doc and c.marker in b.text]
        commands = [b for b in matched if b.lang == "bash" and any(line.startswith(c.marker) for line in b.commands())]
        assert len(commands or matched) == 1, f"{c.doc}: {c.marker!r} matches {len(commands or matched)} blocks"
    for c in INLINE:
        assert c.marker in (REPO / c.doc).read_text(), f"{c.doc} no longer says {c.marker!r}"


def test_every_row_names_a_test_that_exists():
    here = Path(__file__).read_text()
    for c in [*COMMANDS, *INLINE]:
        kind, _, what = c.where.partition(": ") if not c.where.startswith("tests/") else ("elsewhere", "", c.where)
        assert kind in ("here", "checked", "not run", "elsewhere"), c
        if kind in ("here", "checked"):
            assert f"\ndef {what}(" in here, f"{c.marker!r}: no test {what} in this module"
        elif kind == "elsewhere":
            path, name = what.split("::")
            assert f"\ndef {name}(" in (REPO / path).read_text(), f"{c.marker!r}: no test {name} in {path}"


def test_the_yaml_blocks_validate(tmp_path):
    from zocheck_ray.config import JobConfig

    import torch
    from safetensors.torch import save_file

    stand_in = tmp_path / "model"  # the reader's model directory (`/models/...`): one that exists here
    stand_in.mkdir()
    (stand_in / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    save_file({"lm_head.weight": torch.zeros(1)}, stand_in / "model.safetensors")
    for b in [b for b in all_blocks() if b.lang == "yaml"]:
        doc = yaml.safe_load(b.text)
        if str(doc.get("model", "")).startswith("/models/"):
            doc["model"] = str(stand_in)
        JobConfig.model_validate(doc)


def test_the_gpu_cluster_layouts_hold_together():
    import shlex

    from zocheck_ray.config import JobConfig

    rayjob = yaml.safe_load((REPO / "deploy" / "kuberay" / "rayjob.yaml").read_text())
    argv = shlex.split(rayjob["spec"]["entrypoint"])
    (workdir,) = [line.split()[1] for line in (REPO / "deploy" / "Dockerfile").read_text().splitlines()
                  if line.startswith("WORKDIR ")]  # the image holds the repository there
    config = Path(argv[argv.index("--config") + 1])
    JobConfig.model_validate(yaml.safe_load((REPO / config.relative_to(workdir)).read_text()))
    cluster = yaml.safe_load((REPO / "deploy" / "cluster.yaml").read_text())
    assert cluster["docker"]["image"] and (REPO / "deploy" / "Dockerfile").is_file()


# ------------------------------------------------------------------------------------------- the clone


class Clone:
    """The clone, its environment and what its commands left running."""

    def __init__(self, root: Path):
        self.root = root
        self.ray_tmp = tempfile.mkdtemp(prefix="zjd", dir="/tmp")  # short: Ray's socket paths are length-limited
        home = root.parent / "home"
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))  # as after a local ray.init()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_", "PYTEST", "VIRTUAL_ENV"))}
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
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
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


@runs_commands
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


@runs_commands
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


@runs_commands
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


@runs_commands
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


@runs_commands
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


@runs_commands
def test_the_sft_job_file_fails_recovers_and_verifies(clone):
    job = command("docs/sft.md", "zocheck-ray train --config deploy/examples/sft-chat-lora.yaml")
    assert job == INLINE[0].marker  # the README's is the same command
    text = ended_well(clone.run(job))
    assert text.splitlines()[-1] == "verified"
    assert re.search(r"^  rank 0 lost at step 20|^  trainer lost at step 20 \(software\)", text, re.M), text


@runs_commands
def test_the_tune_command_on_two_cores(clone):
    tune = command("docs/tune.md", "zocheck-ray tune --config deploy/examples/sst2-opt.yaml")
    text = ended_well(clone.run(f"{tune} --num-cpus 3 --steps 10"))
    rows = [line for line in text.splitlines() if re.match(r"  (0\.003|0\.01) ", line)]
    assert len(rows) == 4 and all(" True " in row for row in rows), text  # every trial exact


@runs_commands
def test_the_tune_sweep_from_python(clone):
    code = block("docs/tune.md", "results = sweep(").text
    script = ("import ray\nray.init(num_cpus=3)  # docs/tune.md: a two-core machine's local instance, 3 CPUs\n"
              + code + "print('trials', [(r.error, r.metrics.get('exact')) for r in results])\n")
    lines = ended_well(clone.python(script, "sweep.py")).splitlines()
    assert lines[-1] == "trials [(None, True), (None, True)]", "\n".join(lines[-40:])


@runs_commands
def test_the_benchmark_suite_runs_quick(clone):
    quick = [c.marker for c in COMMANDS if c.doc == "docs/benchmarks.md" and "--quick" in c.marker]
    assert quick == ["python -m benchmarks all --out benchmarks/results --quick"]
    ended_well(clone.run(quick[0]))
    assert (clone.root / "benchmarks" / "results" / "summary.md").is_file()
    only = block("docs/benchmarks.md", "--only waste scaling memory").text.splitlines()[-1].split("  #")[0].strip()
    ended_well(clone.run(f"{only} --quick"))


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


@runs_commands
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


@runs_commands
def test_data_parallel_with_a_rank_lost_as_documented(clone, head):
    shutil.copy(clone.root / "deploy" / "examples" / "sst2-opt.yaml", clone.root / "job.yaml")
    text = ended_well(clone.run(f"{command('docs/data-parallel.md', 'zocheck-ray train --config job.yaml')} "
                                "--steps 60", env=head["env"]))
    assert "  ray: joined the cluster at " in text and text.splitlines()[-1] == "verified", text
    assert re.search(r"^  rank 1 lost at step 40 ", text, re.M), text


@runs_commands
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
