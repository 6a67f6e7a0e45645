"""`zocheck-ray status` says what a run is doing: a run that waits for room on its cluster is starting (one line,
exit 0), a running run shows its shadow's metrics and the hyperparameters its resume changed (identity.json's
`changes`, read by the shadow), in one line each and in `--json`.

On the module's own `ray start --head` node of two CPUs (test_cli_clusters's `head`): one endless run takes both,
so a second run waits for room until the first is stopped. Every wait is on a line printed.
"""

from __future__ import annotations

import json
import re
import signal
import uuid

import pytest

from test_cli_clusters import BOUND_SECONDS, clean_env, cli, head, start_train, stop_driver, train_args  # noqa: F401

pytestmark = pytest.mark.slow  # a `ray start --head` node and train drivers that each import torch

STEP_LINE = r"  step +\d+ "


def stop(driver, output, after: int = 0) -> int:
    """SIGINT once it printed a step line from line `after` on; the step its last line says it stopped at."""
    output.wait_for(STEP_LINE, after)
    driver.send_signal(signal.SIGINT)
    lines = output.wait_for_end()
    assert driver.wait(timeout=BOUND_SECONDS) == 130, "\n".join(lines)
    return int(re.match(r"  stopped by SIGINT at step (\d+): ", lines[-1]).group(1))


def test_status_says_a_waiting_run_is_starting_and_a_resumed_run_its_changed_hyperparameters(head, tmp_path):
    env = clean_env(head["ray_tmp"], RAY_AUTH_TOKEN=head["token"])  # drivers join the `ray start` cluster
    storage = tmp_path / "runs"
    first, second = f"first-{uuid.uuid4().hex[:6]}", f"second-{uuid.uuid4().hex[:6]}"
    drivers = []
    try:
        holder, held = start_train(env, train_args(storage, first))  # the node's two CPUs: trainer and shadow
        drivers.append(holder)
        held.wait_for(STEP_LINE)
        waiting, output = start_train(env, train_args(storage, second))
        drivers.append(waiting)
        output.wait_for(r"  waiting for the Ray cluster to have room for rank 0 with the shadow ")

        out = cli(env, "status", second)
        assert out.returncode == 0, out.stderr
        assert re.fullmatch(rf"run '{second}' is starting: its placement group zocheck-{second}-[0-9a-f]{{8}} waits "
                            r"for room in the Ray cluster \(the trainer's and the shadow's resources on one node\)\n",
                            out.stdout), out.stdout
        out = cli(env, "status", second, "--json")
        assert (out.returncode, json.loads(out.stdout)["state"]) == (0, "starting"), out.stdout + out.stderr

        stop(holder, held)  # room: the second run starts and trains
        output.wait_for(STEP_LINE)
        out = cli(env, "status", second, "--json")
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert (doc["state"], doc["run_id"], doc["hyperparameter_changes"]) == ("running", second, [])
        stopped_at = stop(waiting, output)

        # the same run resumed with another learning rate: the records carry it, status shows it
        resumed, output = start_train(env, [*train_args(storage, second), "--set", "zo.lr=0.001"])
        drivers.append(resumed)
        changed, _ = output.wait_for(rf"  zo\.lr changed from 0\.005 to 0\.001 at step {stopped_at} ")
        output.wait_for(STEP_LINE, changed)
        out = cli(env, "status", second, "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["hyperparameter_changes"] == [
            {"step": stopped_at, "field": "zo.lr", "old": 0.005, "new": 0.001}]
        out = cli(env, "status", second)
        assert f"hyperparameter_changes       zo.lr 0.005 -> 0.001 from step {stopped_at}\n" in out.stdout, out.stdout
    finally:
        for driver in drivers:
            stop_driver(driver)
