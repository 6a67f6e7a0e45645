"""A rank's death is seen in the GCS's actor table at once, not after Ray's wait for the death's details.

A call to an actor whose process died fails only once Ray has waited for the death's details
(`timeout_ms_task_wait_for_death_info`, 1 s by default and more on a loaded node), which every
software failure would add to its recovery. This module's Ray instance sets that wait to ten
minutes: the group sees its rank lost though the call has not failed yet. The ceilings below
only keep a regression from hanging the suite; nothing here is timed.
"""

import os
import threading

import pytest
import ray

from support import wait_until
from zocheck_ray.actors.names import actor_state
from zocheck_ray.config import JobConfig
from zocheck_ray.control.group import TrainerGroup

pytestmark = pytest.mark.slow  # a Ray instance of this module's own (its own system config)

DEATH_INFO_WAIT_MS = 600_000


@pytest.fixture(scope="module")
def slow_death_info_ray():
    ray.init(address="local", num_cpus=2, namespace="zocheck", include_dashboard=False, log_to_driver=False,
             _system_config={"timeout_ms_task_wait_for_death_info": DEATH_INFO_WAIT_MS})
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
    rank = Rank.remote()
    assert ray.get(rank.ping.remote())
    group = TrainerGroup(JobConfig(storage=str(tmp_path)), [rank])
    group._note_restarts()  # what `start` does once its ranks are up (this rank has no state to start)
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(result=group.run(10, 0)), daemon=True)
    runner.start()
    runner.join(timeout=120)  # a ceiling for a hang (the call itself fails after ten minutes), not a timing
    assert not runner.is_alive(), "the group waited for the dead rank's call to fail"
    results, failure = outcome["result"]
    assert results == {} and failure is not None
    assert failure.kind == "trainer_lost" and failure.ranks == (0,) and failure.step == 0
    assert wait_until(lambda: actor_state(rank) == "ALIVE", timeout=120)  # Ray restarted it meanwhile
    ray.kill(rank, no_restart=True)
