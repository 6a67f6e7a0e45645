"""The command blocks of README.md and docs/*.md, and where each one runs (`COMMANDS`): the journey
(tests/journey/) runs them as written from a clone; tests/unit/test_documented_table.py holds the table to the
documents, so a new block needs a row."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from support import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
JOURNEY = REPO / "tests" / "journey" / "test_documented_commands.py"
TABLE = REPO / "tests" / "unit" / "test_documented_table.py"


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
            "not run: on two shared cores it takes tens of minutes (bench overhead alone, quick: 1107 s); the "
            "suite's parts run with --quick below, and each benchmark runs small in tests/*/test_bench_*.py"),
    Command("docs/benchmarks.md", "python -m benchmarks all --out benchmarks/results --only waste scaling memory",
            "here: test_the_benchmark_suite_runs_quick", "with --quick (their small sizes), into the clone's "
            "benchmarks/results"),
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

