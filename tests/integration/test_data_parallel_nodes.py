"""Data parallel across nodes: with `placement: spread` on a `ray.cluster_utils.Cluster`, rank 0 and
the shadow share one node and rank 1 runs on another. Removing the node of rank 0 and the shadow
makes the shadow rebuild from durable storage, rank 1 hand it the records it lacks, and rank 0
rejoin from it. An elastic run of {min: 2, max: 3} starts with the 2 ranks the cluster has room
for, grows to 3 when a node is added, loses rank 1's node silently (frozen: no TCP reset) without
stopping the others, and takes
the rank back once Ray has placed it on another node (its state streamed from the shadow's node).
Each run ends with the state of the uninterrupted one-trainer run of its shards, bit for bit.
"""

import os
import signal

import pytest
import ray
from ray.cluster_utils import Cluster

from reference_runs import job_for, uninterrupted_data_parallel_hashes
from support import multi_node_cluster
from zocheck_ray.actors.names import NAMESPACE, trainer_name
from zocheck_ray.testing import run_with_faults as run

pytestmark = pytest.mark.slow  # a 3-node cluster, a rank's node removed

STEPS = 24


HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000, "health_check_failure_threshold": 3}
"""Ray's node health checks, so that a silent node is found dead in seconds rather than Ray's default half minute."""


@pytest.fixture(scope="module")
def cluster():
    # rank 0 and the shadow (STRICT_PACK) on the first node; rank 1 on the second (room for no third rank)
    with multi_node_cluster(2, 1, system_config=HEALTH_CHECKS) as (c, (home, *others)):
        yield c, home, others


def spread_job(tmp_path, trainers=2, scaling=None, **kw):
    return job_for(tmp_path, scaling={"trainers": trainers, "placement": "spread", **(scaling or {})}, steps=STEPS,
                   task=dict(batch_size=6, max_length=32, eval_size=16, eval_interval=10), **kw)


def lose_node_of(c: Cluster, job, rank: int, placed: dict, silent: bool = False):
    """An `on_segment` that removes `rank`'s node at step 12 (and adds a node of the same size in its place).
    `silent`: the node's processes are frozen instead, their sockets open, as a machine lost without a TCP reset;
    removed once Ray has placed the rank elsewhere."""

    def where(r: int) -> str:
        actor = ray.get_actor(trainer_name(job.run_id, r), namespace=NAMESPACE)
        return ray.get(actor.node_id.remote())

    def on_segment(progress, metrics) -> None:
        if "before" in placed:
            placed.setdefault("after", where(rank))
            if placed.get("frozen"):
                for pid in placed.pop("frozen"):
                    os.kill(pid, signal.SIGKILL)
                c.remove_node(next(n for n in c.worker_nodes if n.node_id == placed["before"]), allow_graceful=False)
        elif progress.step >= 12:
            placed.update(before=where(rank), ranks=[where(0), where(1)])
            node = next(n for n in c.worker_nodes if n.node_id == placed["before"])
            cpus = int(node_cpus(node.node_id))
            if silent:
                placed["frozen"] = freeze(node.node_id)
            else:
                c.remove_node(node)
            c.add_node(num_cpus=cpus)

    return on_segment


def freeze(node_id: str) -> list[int]:
    """SIGSTOP node `node_id`'s raylet and every process under it (its workers and agents); their pids."""
    parents = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:  # gone meanwhile
            continue
    marker = f"--node_id={node_id}".encode()
    raylet = next(pid for pid in parents
                  if (command := _cmdline(pid)).split(b" ", 1)[0].endswith(b"/raylet") and marker in command)
    frozen = [raylet]
    while found := [pid for pid, parent in parents.items() if parent in frozen and pid not in frozen]:
        frozen += found
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    return frozen


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ")
    except OSError:
        return b""


def node_cpus(node_id: str) -> float:
    return next(n["Resources"]["CPU"] for n in ray.nodes() if n["NodeID"] == node_id)


def test_an_elastic_run_grows_when_a_node_appears_and_loses_the_node_of_rank_1_without_stopping(cluster, tmp_path):
    from zocheck_ray.control.callbacks import RunCallback

    class Placed(RunCallback):  # holds the run at a boundary until Ray has placed what the cluster now has room for
        def on_segment(self, run, segment):
            if segment.progress.step >= 4 and not added:
                added.append(c.add_node(num_cpus=1))  # room for a third rank
            ray.get([vacancy.ready for vacancy in run.group.vacancies] if added else [])
            for actor, _ in list(run.group.departed.values()):
                ray.get(actor.readiness.remote())  # sent while Ray starts the process, it waits for it

    c, home, _ = cluster
    # rank 1's node goes silent (a machine lost without a TCP reset): the others wait in their exchange until Ray
    # finds the node dead, then give the exchange up for the controller's plan, long before gloo's timeout
    job = spread_job(tmp_path, trainers={"min": 2, "max": 3}, scaling={"collective_timeout_seconds": 300},
                     log_interval=4)
    placed, added, lines = {}, [], []
    summary = run(job, progress=lines.append, callbacks=[Placed()],
                  on_segment=lose_node_of(c, job, 1, placed, silent=True))
    assert any("2 of 3 data-parallel ranks (spread; waiting for room" in line for line in lines), lines
    assert placed["ranks"][0] == home.node_id and placed["before"] != home.node_id
    assert placed["after"] not in (home.node_id, placed["before"])  # restored there from the shadow's image
    assert summary.recoveries == []  # rank 0 never stopped
    assert [(c.kind, c.ranks) for c in summary.group_changes] == [("join", 3), ("shrink", 2), ("join", 3)]
    assert summary.group_changes[0].step == 8  # the first boundary after its process was built
    assert summary.group_changes[0].cause.startswith("scale-up: resources for rank 2 appeared")
    assert summary.group_changes[1].cause == "rank 1 lost"
    # the stall counts from the start of the exchange given up; gloo's timeout would end it after the plan came
    assert 0 < summary.group_changes[1].plan_wait_seconds < summary.group_changes[1].stall_seconds
    assert_exact(summary, job, ranks=3)


def test_losing_the_node_of_rank_0_and_the_shadow_recovers_from_durable_storage_exactly(cluster, tmp_path):
    c, _, _ = cluster
    job = spread_job(tmp_path)
    placed: dict = {}
    summary = run(job, progress=None, on_segment=lose_node_of(c, job, 0, placed))
    assert placed["after"] != placed["before"] != placed["ranks"][1]
    (recovery,) = summary.recoveries
    assert recovery.rank == 0 and recovery.image_source == "durable" and recovery.recovered_step == 12
    assert summary.shadow_restarts == 1
    assert_exact(summary, job)


def assert_exact(summary, job, ranks=2):
    expected = uninterrupted_data_parallel_hashes(job)
    assert summary.final_state_hash == summary.shadow_state_hash == expected[STEPS]
    assert summary.rank_state_hashes == [expected[STEPS]] * ranks
    for step, digest in summary.step_hashes.items():
        assert digest == expected[step], f"state after step {step} differs"
