"""The ranks' collective without Ray: a dead peer named by its refused liveness socket, and a rendezvous that
a newer plan ends instead of the store's timeout."""

import socket

import pytest

from zocheck_ray.runtime.parallel.collective import LossGroup, RankLostError, alive, liveness_port, open_rendezvous


def closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: a connection to it is refused, as to a dead process's
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_whose_liveness_socket_is_closed_is_named_lost():
    group = LossGroup(rank=0, ranks=3)
    group.peers = {1: ("127.0.0.1", liveness_port()), 2: ("127.0.0.1", closed_port())}
    assert alive(group.peers[1]) and not alive(group.peers[2])
    assert group.lost_peers() == [2]


def test_no_peer_is_named_lost_while_every_one_answers():
    group = LossGroup(rank=0, ranks=2)
    group.peers = {1: ("127.0.0.1", liveness_port())}
    assert group.lost_peers(timeout=0.1) == []


def test_a_newer_plan_ends_the_wait_for_a_rank_that_never_arrives():
    # Rank 0 of a planned pair whose other rank died before it arrived: it leaves at once for the next plan.
    store = open_rendezvous("127.0.0.1", 2, timeout=600)
    group = LossGroup(rank=0, ranks=2, timeout=600)
    with pytest.raises(RankLostError, match="a newer group was planned"):
        group.join("127.0.0.1", store.port, store=store, abandon=lambda: True)
    assert not group.joined and group.key is None


SILENT_PEER = """
import os, signal, sys
from zocheck_ray.runtime.parallel.collective import LossGroup
LossGroup(rank=1, ranks=2, timeout=600).join("127.0.0.1", int(sys.argv[1]))
os.kill(os.getpid(), signal.SIGSTOP)  # silent, its sockets open: a node lost without a TCP reset
"""


def test_an_exchange_with_a_silent_peer_is_given_up_for_a_newer_group_at_once():
    # gloo would wait out its timeout (600 s here) for the frozen peer, and leaving the group would wait for that
    # too: the exchange ends at the plan, the group is left at once, and the next group works.
    import subprocess
    import sys
    import threading

    from zocheck_ray.runtime.parallel.collective import GroupAbandoned

    store = open_rendezvous("127.0.0.1", 2, timeout=600)
    peer = subprocess.Popen([sys.executable, "-c", SILENT_PEER, str(store.port)])
    group = LossGroup(rank=0, ranks=2, timeout=600)
    try:
        group.join("127.0.0.1", store.port, store=store)
        asked = []
        with pytest.raises(GroupAbandoned, match="a newer group was planned during the exchange"):
            group.gather((1.0,), abandon=lambda: asked.append(1) or len(asked) > 2)
        leaving = threading.Thread(target=group.leave)
        leaving.start()
        leaving.join(timeout=60)  # a ceiling, far below the exchange's 600 s
        assert not leaving.is_alive() and not group.joined
        alone = LossGroup(rank=0, ranks=1, timeout=600)
        alone.join("127.0.0.1", alone.listen("127.0.0.1"))
        assert alone.gather((2.0,)) == [(2.0,)]
        alone.leave()
    finally:
        peer.kill()
        peer.wait()
        group.leave()
