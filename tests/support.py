"""Helpers the tests share (`tests/` is on the path of every test, as the conftest's directory).

    from support import REPO, encode, multi_node_cluster, trained, wait_until

The fixtures are in `conftest.py`; the uninterrupted reference runs every recovered run is
compared with are in `reference_runs.py`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
"""The repository's root."""


def wait_until(predicate, timeout: float = 120.0) -> bool:
    """Whether `predicate()` became true within `timeout` seconds: a safety net for a state that must
    come, never the thing under test (`assert wait_until(...)`)."""
    from zocheck_ray.actors.link import pauses  # a predicate may ask the GCS or an actor: ever less often

    deadline, waits = time.monotonic() + timeout, pauses(most=0.1)
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(next(waits))
    return True


def encode(records) -> bytes:
    """Step records as the trainer pushes them: their encodings back to back."""
    return b"".join(r.to_bytes() for r in records)


def trained(job, steps: int):
    """`job`'s model trained `steps` ZO steps without Ray: (initial state, optimizer, records)."""
    from zocheck_ray.core import ZOOptimizer
    from zocheck_ray.workload.models import build_model, trainable_parameters

    model = build_model(job.model, job.dtype)
    opt = ZOOptimizer(trainable_parameters(model), job.zo)
    initial = {k: v.detach().clone() for k, v in opt.state_tensors().items()}
    ids = torch.arange(24).reshape(2, 12) % 100
    records = [opt.step(lambda: model(input_ids=ids, labels=ids).loss, seed=t) for t in range(steps)]
    return initial, opt, records


@contextmanager
def multi_node_cluster(*node_cpus: int):
    """A `ray.cluster_utils.Cluster` on this machine: a head without CPUs (so nothing is scheduled on a
    node a test cannot remove) and one node per entry of `node_cpus`, this process its driver.
    Yields (cluster, nodes); shut down on leaving."""
    import ray
    from ray.cluster_utils import Cluster

    from zocheck_ray.actors.names import NAMESPACE

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    # the driver joins before the other nodes exist: it is then the head's (a driver attaches to any node of
    # its host before Ray 2.54, and a test must never remove the driver's own node)
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    nodes = [cluster.add_node(num_cpus=cpus) for cpus in node_cpus]
    cluster.wait_for_nodes()
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
