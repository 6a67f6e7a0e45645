"""A rank's death is seen in Ray's state API at once, not after Ray's wait for the death's details.

A call to an actor whose process died fails only once Ray has waited for the death's details
(`timeout_ms_task_wait_for_death_info`, 1 s by default and more on a loaded node), which every
software failure would add to its recovery. This module's Ray instance runs its dashboard (which
serves the state API) and sets that wait to ten minutes: the group sees its rank lost though the
call has not failed yet, and a whole run with a standby recovers without ever waiting on it. The
ceilings below only keep a regression from hanging the suite; nothing here is timed. Without a dashboard the calls' failures say it (test_failure_detection_fallback.py).
"""

import os
import threading

import pytest
import ray

from conftest import free_port
from reference_runs import assert_exact, job_for, uninterrupted_hashes
from support import wait_until
from zocheck_ray.actors.names import NAMESPACE, actor_states, actor_status, describe_actor, trainer_name
from zocheck_ray.config import JobConfig
from zocheck_ray.control import RunCallback
from zocheck_ray.control.group import TrainerGroup
from zocheck_ray.testing import run_with_faults

pytestmark = pytest.mark.slow  # a Ray instance of this module's own (its own system config)

DEATH_INFO_WAIT_MS = 600_000


@pytest.fixture(scope="module")
def slow_death_info_ray():
    ray.init(address="local", num_cpus=3, namespace=NAMESPACE, include_dashboard=True, log_to_driver=False,
             dashboard_port=free_port(),  # never the default, which another test's Ray may hold
             _system_config={"timeout_ms_task_wait_for_death_info": DEATH_INFO_WAIT_MS})
    assert actor_states() is not None, "the state API answers where the cluster runs its dashboard"
    yield
    ray.shutdown()


@ray.remote(max_restarts=1)
class Rank:
    """A rank whose process exits inside `run` (the first incarnation), as a crashed trainer's does."""

    def run(self, target: int, durable_next: int | None):
        if not ray.get_runtime_context().was_current_actor_reconstructed:
            os._exit(1)

    def ping(self) -> bool:
        return True


def test_a_rank_that_dies_in_its_segment_is_lost_before_its_call_fails(slow_death_info_ray, tmp_path):
    job = JobConfig(storage=str(tmp_path))
    rank = Rank.options(name=trainer_name(job.run_id, 0), namespace=NAMESPACE).remote()
    assert ray.get(rank.ping.remote())
    group = TrainerGroup(job, [rank])
    group._note_restarts()  # what `start` does once its ranks are up (this rank has no state to start)
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(result=group.run(10, 0)), daemon=True)
    runner.start()
    runner.join(timeout=120)  # a ceiling for a hang (the call itself fails after ten minutes), not a timing
    assert not runner.is_alive(), "the group waited for the dead rank's call to fail"
    results, failure = outcome["result"]
    assert results == {} and failure is not None
    assert failure.kind == "trainer_lost" and failure.ranks == (0,) and failure.step == 0
    # Ray restarted it meanwhile: one restart, its new process alive
    assert wait_until(lambda: (s := actor_status(group.names[0])) is not None and s.state == "ALIVE", timeout=120)
    assert actor_status(group.names[0]).restarts == 1
    ray.kill(rank, no_restart=True)


@ray.remote(max_restarts=1)
class _RestartsSlowly:
    """Its restart waits in the constructor until `gate` exists: a restart that cannot finish by itself."""

    def __init__(self, gate: str):
        import time

        while ray.get_runtime_context().was_current_actor_reconstructed and not os.path.exists(gate):
            time.sleep(0.01)

    def ping(self) -> str:
        return "alive"


def test_waiting_for_a_restart_ends_when_the_state_api_reports_the_actor_alive_again(slow_death_info_ray, tmp_path):
    from zocheck_ray.actors.link import wait_until_alive

    gate, name = tmp_path / "gate", "zocheck-restarts-slowly"
    actor = _RestartsSlowly.options(name=name, namespace=NAMESPACE).remote(str(gate))
    assert ray.get(actor.ping.remote()) == "alive"
    assert describe_actor(name).startswith("ALIVE (pid ")
    ray.kill(actor, no_restart=False)
    assert wait_until(lambda: actor_status(name).state == "RESTARTING")  # Ray has seen the kill
    assert describe_actor(name).startswith("RESTARTING (")
    waiter = threading.Thread(target=wait_until_alive, args=(name,))
    waiter.start()
    waiter.join(timeout=1.0)
    assert waiter.is_alive()  # the constructor cannot finish before the gate opens: still restarting
    gate.touch()
    waiter.join(timeout=120)
    assert not waiter.is_alive()
    assert ray.get(actor.ping.remote()) == "alive"
    assert describe_actor(name).endswith(", 1 restarts)")
    ray.kill(actor)


class StandbyBuilt(RunCallback):
    """Holds the run after each segment until its standby has built its model: the failure meets it ready."""

    def on_segment(self, run, segment):
        assert wait_until(run.group.prepare_standby, timeout=300)


def test_a_lost_trainer_is_seen_and_replaced_by_the_standby_exactly(slow_death_info_ray, tmp_path):
    """A whole run: its trainer dies at step 13, the state API says so, the standby is promoted, and the run
    ends equal to the uninterrupted one (no call to the dead process is waited on: that wait is ten minutes)."""
    job = job_for(tmp_path, failure={"standby": True})
    summary = run_with_faults(job, fail_at=[13], progress=None, callbacks=[StandbyBuilt()])
    (recovery,) = summary.recoveries
    assert recovery.failed_at_step == 13 and recovery.replaced_by == "standby"
    assert_exact(summary, uninterrupted_hashes(job))
