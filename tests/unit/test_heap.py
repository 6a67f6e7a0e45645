"""An actor's start-up runs with the cyclic collector paused, and ends with its heap settled."""

import gc

import pytest

from zocheck_ray.host.heap import settling_heap


class Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture
def collector():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_the_block_runs_without_the_collector_and_leaves_its_survivors_frozen_and_its_garbage_freed(collector):
    gc.enable()
    frozen = gc.get_freeze_count()
    with settling_heap():
        assert not gc.isenabled()
        kept = [Cycle() for _ in range(1000)]  # alive after the block: frozen
        for _ in range(1000):
            Cycle()  # cyclic garbage: only a collector pass frees it
        assert gc.get_count()[0] > gc.get_threshold()[0]  # no pass ran: the young generation is past its threshold
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + 1000 and all(gc.is_tracked(c) for c in kept)
    assert not any(type(o) is Cycle for o in gc.get_objects())  # the survivors are out of reach, the rest freed


def test_a_block_that_raises_still_settles_and_a_paused_collector_stays_paused(collector):
    gc.disable()
    frozen = gc.get_freeze_count()
    kept = []
    with pytest.raises(RuntimeError), settling_heap():
        kept.append(Cycle())  # alive after the block: frozen though the block raised
        raise RuntimeError("a constructor failed")
    assert not gc.isenabled() and gc.get_freeze_count() > frozen and gc.is_tracked(kept[0])
