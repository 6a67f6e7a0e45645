"""Data parallel across nodes: with `placement: spread` on a 3-node `ray.cluster_utils.Cluster`,
rank 0 and the shadow share one node and rank 1 runs on another; removing rank 1's node
makes Ray reschedule it on the third node, where it rejoins at the survivors' step, and the
run ends with the state of the uninterrupted two-rank run, bit for bit.
"""

import pytest
import ray
from ray.cluster_utils import Cluster

from reference_runs import job_for, uninterrupted_data_parallel_hashes
from zocheck_ray.actors.ray_actors import NAMESPACE, trainer_name
from zocheck_ray.controller import run

STEPS = 24


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    home = c.add_node(num_cpus=2)                        # rank 0 and the shadow (STRICT_PACK)
    others = [c.add_node(num_cpus=1) for _ in range(2)]  # rank 1, and the node it moves to
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
    yield c, home, others
    ray.shutdown()
    c.shutdown()


def test_losing_the_node_of_rank_1_recovers_it_on_another_node_exactly(cluster, tmp_path):
    c, home, _ = cluster
    job = job_for(tmp_path, trainers=2, placement="spread", steps=STEPS,
                  task=dict(batch_size=6, max_length=32, eval_size=16, eval_interval=10))
    placed: dict = {}

    def where(rank: int) -> str:
        actor = ray.get_actor(trainer_name(job.run_id, rank), namespace=NAMESPACE)
        return ray.get(actor.node_id.remote())

    def lose_rank_1_node(progress: dict, metrics: dict) -> None:
        if "before" in placed:
            placed.setdefault("after", where(1))
        elif progress["step"] >= 12:
            placed.update(before=where(1), rank0=where(0))
            c.remove_node(next(n for n in c.worker_nodes if n.node_id == placed["before"]))

    summary = run(job, progress=None, on_segment=lose_rank_1_node)
    assert placed["rank0"] == home.node_id and placed["before"] != home.node_id
    assert placed["after"] not in (home.node_id, placed["before"])
    (recovery,) = summary.recoveries
    assert recovery.rank == 1 and recovery.failed_at_step == 12 and recovery.recovered_step == 12
    expected = uninterrupted_data_parallel_hashes(job)
    assert summary.final_state_hash == summary.shadow_state_hash == expected[STEPS]
    assert summary.rank_state_hashes == [expected[STEPS]] * 2
    for step, digest in summary.step_hashes.items():
        assert digest == expected[step], f"state after step {step} differs"
