"""`zocheck-ray status` says what a run is doing: a run that waits for room on its cluster is starting (one line,
exit 0); a running run shows its shadow's metrics and the hyperparameters its resume changed (identity.json's
`changes`, read by the shadow), in `--json` and in one line of the text. And beside a `ray start` cluster,
`zocheck-ray tune --num-cpus` refuses in one line that says what to do.

On the module's own `ray start --head` node of two CPUs (test_cli_clusters's `head`): a placement group of another
process takes both CPUs, so the run waits for room until that process lets go. The run resumes one trained in this
process first (no Ray), with another learning rate. Every wait is on a line printed.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import uuid

import pytest

from support import REPO
from test_cli_clusters import BOUND_SECONDS, clean_env, cli, head, one_line, start_train, stop_driver, train_args  # noqa: F401

pytestmark = pytest.mark.slow  # a `ray start --head` node and a train driver that imports torch

STEP_LINE = r"  step +\d+ "
TRAINED = 10
"""Steps the run trained before it is resumed."""

HOLD_CPUS = """
import sys
import ray
from ray.util.placement_group import placement_group

ray.init(address=sys.argv[1], log_to_driver=False)
group = placement_group([{"CPU": float(sys.argv[2])}])
ray.get(group.ready())
print("held", flush=True)
sys.stdin.read()  # until the test closes it: the group goes with this process
"""
"""Another job of the cluster, holding CPUs in a placement group of its own."""


def trained_in_process(storage, run_id: str) -> None:
    """`train_args`' job trained `TRAINED` steps without Ray, its identity recorded as a driver records it."""
    from zocheck_ray.config import load_job_config
    from zocheck_ray.control.identity import check_identity
    from zocheck_ray.control.startup import build_task_once
    from zocheck_ray.demo import EMBEDDED_DEFAULT
    from zocheck_ray.testing.in_process import run_in_process

    job = load_job_config(None, [f"run_id={run_id}", "log_interval=5", f"shadow.snapshot_interval={TRAINED}"],
                          base=EMBEDDED_DEFAULT, steps=TRAINED, storage=str(storage))
    check_identity(job, build_task_once(job), None, lambda line: None).record()
    assert run_in_process(job).metrics.durable_step == TRAINED


def test_status_says_a_waiting_run_is_starting_then_shows_the_hyperparameters_its_resume_changed(head, tmp_path):
    env = clean_env(head["ray_tmp"], RAY_AUTH_TOKEN=head["token"])  # drivers join the `ray start` cluster
    storage, run_id = tmp_path / "runs", f"resumed-{uuid.uuid4().hex[:6]}"
    trained_in_process(storage, run_id)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_CPUS, head["gcs"], "2"], env={**env, "RAY_AUTH_MODE": "token"},
                              cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    driver = None
    try:
        assert holder.stdout.readline() == "held\n"
        driver, output = start_train(env, [*train_args(storage, run_id), "--set", "zo.lr=0.001"])
        output.wait_for(rf"  zo\.lr changed from 0\.005 to 0\.001 at step {TRAINED} \(the step records carry it\)$")
        output.wait_for(r"  waiting for the Ray cluster to have room for rank 0 with the shadow ")

        out = cli(env, "status", run_id)
        assert out.returncode == 0, out.stderr
        assert re.fullmatch(rf"run '{run_id}' is starting: its placement group zocheck-{run_id}-[0-9a-f]{{8}} waits "
                            r"for room in the Ray cluster \(the trainer's and the shadow's resources on one node\)\n",
                            out.stdout), out.stdout

        holder.stdin.close()  # room: the run starts and trains
        assert holder.wait(timeout=BOUND_SECONDS) == 0
        resumed, _ = output.wait_for(rf"  resumed at step {TRAINED} from durable storage ")
        output.wait_for(STEP_LINE, resumed)
        out = cli(env, "status", run_id, "--json")
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert (doc["state"], doc["run_id"], doc["hyperparameter_changes"]) == \
            ("running", run_id, [{"step": TRAINED, "field": "zo.lr", "old": 0.005, "new": 0.001}])
        out = cli(env, "status", run_id)
        assert f"\nhyperparameter_changes       zo.lr 0.005 -> 0.001 from step {TRAINED}\n" in out.stdout, out.stdout

        driver.send_signal(signal.SIGINT)
        assert driver.wait(timeout=BOUND_SECONDS) == 130, "\n".join(output.wait_for_end())
    finally:
        if holder.poll() is None:
            holder.kill()
        if driver is not None:
            stop_driver(driver)


def test_tune_num_cpus_beside_a_ray_start_cluster_is_refused_in_one_line(head):
    env = clean_env(head["ray_tmp"], RAY_AUTH_TOKEN=head["token"])
    out = cli(env, "tune", "--config", "deploy/examples/sst2-opt.yaml", "--grid", "zo.lr=3e-3,1e-2", "--num-cpus", "3")
    assert out.returncode == 2 and one_line(out.stderr) == (
        f"zocheck-ray tune: --num-cpus sizes a local Ray instance, but this sweep joins the cluster at "
        f"{head['recorded']} (the cluster `ray start` runs on this machine): give that cluster's node the CPUs (ray "
        "stop, then ray start --head --num-cpus=3), or start a local instance for the sweep with RAY_ADDRESS=local")
