"""Where the cluster runs without its dashboard there is no state API: a rank's death is seen when its call
fails (after Ray's wait for the death's details), and the run recovers as it does with one, exactly.

The shared local instance (`local_ray`) is started without the dashboard, as a cluster may be, so every
recovery test on it takes this path and ends exact (test_ray_recovery.py, test_standby.py's promotions); with
the state API: test_failure_detection.py.
"""

import pytest
import ray

from support import wait_until
from zocheck_ray.actors.names import NAMESPACE, actor_states, describe_actor, trainer_name
from zocheck_ray.config import JobConfig
from zocheck_ray.control.group import TrainerGroup

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]


@pytest.fixture(autouse=True)
def without_state_api():
    assert actor_states() is None, "local_ray runs without the dashboard: these tests are of the fallback"


@ray.remote(max_restarts=1)
class Rank:
    """A rank whose process exits inside `run` (the first incarnation), as a crashed trainer's does."""

    def run(self, target: int, durable_next: int | None):
        import os

        if not ray.get_runtime_context().was_current_actor_reconstructed:
            os._exit(1)

    def pid(self) -> int:
        import os

        return os.getpid()


def test_a_rank_that_dies_in_its_segment_is_lost_when_its_call_fails(tmp_path):
    job = JobConfig(storage=str(tmp_path))
    rank = Rank.options(name=trainer_name(job.run_id, 0), namespace=NAMESPACE).remote()
    first = ray.get(rank.pid.remote())
    group = TrainerGroup(job, [rank])
    results, failure = group.run(10, 0)
    assert results == {} and failure is not None
    assert failure.kind == "trainer_lost" and failure.ranks == (0,) and failure.step == 0
    # Ray restarts it: the process that answers is a new one, and the group counts it as a rank again
    assert wait_until(lambda: group.lost_ranks() == ())
    second = ray.get(rank.pid.remote())
    assert second != first
    # without the state API the actor is described by its own answer
    assert describe_actor(group.names[0]) == (f"ALIVE (pid {second}, by its own answer: Ray's state API does not "
                                              "answer without a dashboard)")
    ray.kill(rank, no_restart=True)

