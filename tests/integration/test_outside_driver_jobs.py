"""On a `ray.cluster_utils.Cluster` of one node (with a dashboard; no token authentication): the case of
test_outside_driver.py from a driver beside it and from jobs sent with `ray job submit`, then a driver whose token
mode is not the cluster's, refused before it connects, and a script that connected itself so, whose run fails in one
line when Ray ends its shadow before it runs. The cluster is started once for the module (see
test_outside_driver.py); every driver has a token at hand.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid

import pytest

from support import REPO
from test_outside_driver import TRAIN_ARGS, clusters, home, join_run_and_refuse  # noqa: F401 (the fixtures)

pytestmark = pytest.mark.slow  # a cluster of its own, and drivers that each import torch

ONE_NODE = "Cluster of one node"


@pytest.mark.parametrize("kind", [ONE_NODE, "ray job submit"])
def test_a_driver_joins_the_cluster_runs_verified_and_other_jobs_of_its_run_are_refused(clusters, kind, tmp_path):
    join_run_and_refuse(clusters, kind, tmp_path)


def test_a_driver_in_token_mode_for_a_cluster_without_it_is_refused_in_one_line(clusters, tmp_path):
    cluster = clusters(ONE_NODE)
    out = subprocess.run([sys.executable, "-m", "zocheck_ray", "train", *TRAIN_ARGS, "--storage", str(tmp_path),
                          "--address", cluster.gcs], env={**cluster.env, "RAY_AUTH_MODE": "token"}, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stdout + out.stderr
    (line,) = [line for line in out.stderr.splitlines() if line.startswith("zocheck-ray train: ")]
    assert line == (f"zocheck-ray train: RAY_AUTH_MODE=token, but the Ray cluster at {cluster.gcs} does not use token "
                    "authentication: its processes call this one without a token, which token mode refuses, and Ray "
                    "ends every actor of the run before it runs; unset RAY_AUTH_MODE (or set it to disabled) to join "
                    "it")


LIBRARY_DRIVER = """
import json, sys
import ray
from zocheck_ray.actors.names import NAMESPACE
from zocheck_ray.config import load_job_config
from zocheck_ray.control import RunFailedError, run
from zocheck_ray.demo import EMBEDDED_DEFAULT

address, run_id, storage = sys.argv[1:]
ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)  # in the mode the environment says
job = load_job_config(None, [f"run_id={run_id}", "shadow.snapshot_interval=5"], base=EMBEDDED_DEFAULT, steps=10,
                      storage=storage)
try:
    run(job, progress=None)
except RunFailedError as exc:
    left = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    print(json.dumps({"error": str(exc), "actors": ray.util.list_named_actors(all_namespaces=True),
                      "groups": left}))
"""


def test_an_actor_ray_cannot_start_fails_the_run_in_one_line_that_names_it_and_ray_s_reason(clusters, tmp_path):
    """A script that connected itself in token mode to a cluster without it: Ray ends each actor it starts before
    it runs. The run fails with one line naming the shadow, Ray's reason and the fix, and leaves nothing."""
    cluster = clusters(ONE_NODE)
    run_id = f"lib-{uuid.uuid4().hex[:6]}"
    out = subprocess.run([sys.executable, "-c", LIBRARY_DRIVER, cluster.gcs, run_id, str(tmp_path)],
                         env={**cluster.env, "RAY_AUTH_MODE": "token"}, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip(), out.stdout + out.stderr
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert "\n" not in failed["error"], failed["error"]
    # Ray's reason is whichever its GCS recorded first ("The actor is dead because all references to the actor
    # were removed ... The actor never ran", or "System error: Actor creation cancelled")
    assert re.fullmatch(rf"run '{run_id}' could not start: Ray could not start its actor zocheck-shadow-{run_id}: "
                        r"(The actor is dead because all references to the actor were removed.*The actor never ran"
                        r"|System error: Actor creation cancelled)[^;]*; RAY_AUTH_MODE=token, but the Ray cluster at "
                        r"\S+ does not use token authentication: .*; unset RAY_AUTH_MODE \(or set it to disabled\) "
                        r"where this process starts", failed["error"]), failed["error"]
    assert failed["actors"] == [] and failed["groups"] == []
