"""Host failure: the node holding the trainer and the shadow is removed from a real
multi-node `ray.cluster_utils.Cluster`; Ray reschedules the placement group onto the
surviving node, the shadow rebuilds from durable storage (a real S3 endpoint on
loopback: the storage a lost node cannot take with it), the trainer recovers from it,
and the final state is the one an uninterrupted run reaches, the driver never held up
by a state API it cannot find. The same loss with a local
directory as storage: test_data_parallel_nodes.py (rank 0's node, the shadow's too).
"""

import logging
import socket

import pytest
import ray
from ray.cluster_utils import Cluster

from zocheck_ray.actors.names import NAMESPACE, actor_states, trainer_name
from zocheck_ray.config import JobConfig
from zocheck_ray.testing import run_with_faults as run
from reference_runs import SMALL_TASK, STEPS, assert_exact, uninterrupted_hashes
from support import multi_node_cluster

pytestmark = pytest.mark.slow  # multi-node clusters, node loss, rebuilds from durable storage

NODE_CPUS = 2


@pytest.fixture(scope="module")
def cluster():
    """The cluster, its dashboard's port taken (as by another Ray on the host): its head's dashboard does not
    start, and the state API's address is nowhere to be found."""
    with socket.create_server(("0.0.0.0", 0)) as taken:
        with multi_node_cluster(NODE_CPUS, NODE_CPUS, dashboard_port=taken.getsockname()[1]) as (c, workers):
            yield c, workers


def test_a_state_api_that_cannot_be_found_is_asked_once(cluster, caplog, monkeypatch):
    # Ray's StateApiClient looks for the dashboard's address in the GCS for 40 s: asked again every 30 s, a
    # host-failure run took 500 s instead of 15
    from zocheck_ray.actors import names

    monkeypatch.setattr(names, "STATE_API_RETRY_SECONDS", 0.0)
    with caplog.at_level(logging.DEBUG, logger="zocheck_ray.actors.names"):
        assert actor_states() is None and actor_states() is None
    asked = [r for r in caplog.records if "state API does not answer" in r.getMessage()]
    assert len(asked) == 1 and "Could not read 'dashboard' from GCS" in asked[0].getMessage(), caplog.text


def lose_trainer_node(c: Cluster, job: JobConfig, lost: list):
    def kill() -> None:
        trainer = ray.get_actor(trainer_name(job.run_id), namespace=NAMESPACE)
        node_id = ray.get(trainer.node_id.remote())
        node = next(n for n in c.worker_nodes if n.node_id == node_id)
        c.remove_node(node)
        lost.append(node_id)
        c.add_node(num_cpus=NODE_CPUS)  # keep a spare for the next test

    return kill


@pytest.mark.ray_range
def test_node_loss_rebuilds_the_pair_from_durable_storage(cluster, s3_bucket):
    c, _ = cluster
    root, options = s3_bucket
    job = JobConfig.model_validate(dict(steps=STEPS, storage=root, storage_options=options,
                                        shadow={"snapshot_interval": 8}, log_interval=6, hash_every_step=True,
                                        zo=dict(lr=2e-3, eps=1e-3),
                                        task=SMALL_TASK))
    lost: list = []
    summary = run(job, fail_at=[21], fail_mode="host", progress=None, kill_node=lose_trainer_node(c, job, lost))
    assert len(lost) == 1
    (recovery,) = summary.recoveries
    assert recovery.mode == "host"
    assert recovery.image_source == "durable"
    assert recovery.recovered_step <= 21
    assert_exact(summary, uninterrupted_hashes(job))
