"""The data-parallel ranks' collective: a `torch.distributed` gloo process group among trainer actors.

    group = LossGroup(rank=1, ranks=2)
    group.join("127.0.0.1", 29512)                    # the port rank 0's `listen` opened
    tables = group.gather(encode(table))              # every rank's shard table, in rank order

Rank 0 opens a TCP store, every rank joins through it (as Ray Train does). An exchange carries a few float64
numbers per shard, so gloo serves CPU and GPU ranks alike. A dead peer makes `gather` raise `RankLostError`,
and `lost_peers` names it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

TIMEOUT_SECONDS = 600.0
"""How long a join or a gather waits by default (`scaling.collective_timeout_seconds`)."""


PROBE_SECONDS = 1.0
"""`lost_peers`' wait for a lost node (a dead process's refusal is at once)."""
ARRIVAL_POLL_SECONDS = 0.01
ABANDON_POLL_SECONDS = 0.2
"""How often an abandonable exchange checks."""


class RankLostError(RuntimeError):
    """The collective failed: a peer rank died (or could not be reached)."""


class GroupAbandoned(RankLostError):
    """An exchange given up for a newer group (a silent peer: a node lost without a TCP reset)."""


_liveness: socket.socket | None = None
_liveness_lock = threading.Lock()


def liveness_port() -> int:
    """The port of this process's liveness socket, which only its end closes."""
    global _liveness
    with _liveness_lock:
        if _liveness is None:
            listener = socket.create_server(("", 0), backlog=64)
            threading.Thread(target=_answer, args=(listener,), name="zocheck-liveness", daemon=True).start()
            _liveness = listener
        return _liveness.getsockname()[1]


def _answer(listener: socket.socket) -> None:
    while True:
        connection, _ = listener.accept()
        connection.close()


def local_address(toward: str, port: int) -> str:
    if ipaddress.ip_address(toward).is_loopback:
        return toward
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((toward, port))
        return probe.getsockname()[0]


def alive(address: tuple[str, int], timeout: float = PROBE_SECONDS) -> bool:
    try:
        socket.create_connection(address, timeout=timeout).close()
        return True
    except OSError:
        return False


def open_rendezvous(address: str, ranks: int, timeout: float = TIMEOUT_SECONDS) -> dist.TCPStore:
    """A new group's rendezvous (rank 0's TCP store on a free port), opened without leaving the current group,
    so an elastic rank opens it while its training thread waits."""
    return dist.TCPStore(address, 0, ranks, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


class LossGroup:
    """This rank's membership of the ranks' process group (the default torch.distributed group)."""

    def __init__(self, rank: int, ranks: int, timeout: float = TIMEOUT_SECONDS):
        self.rank, self.ranks, self.timeout = rank, ranks, timeout
        self.generation = 0
        """How often the group was formed."""
        self._store: dist.TCPStore | None = None
        """Rank 0's listening rendezvous between `listen` and `join`."""
        self.key: tuple[str, int] | None = None

        self.peers: dict[int, tuple[str, int]] = {}
        self._work = None

    @property
    def joined(self) -> bool:
        return dist.is_initialized()

    def listen(self, address: str, timeout: float | None = None) -> int:
        """Rank 0: open the group's rendezvous (a TCP store on a free port of `address`); returns the port."""
        self.leave()
        self._store = open_rendezvous(address, self.ranks, timeout or self.timeout)
        return self._store.port

    def join(self, address: str, port: int, timeout: float | None = None,
             store: dist.TCPStore | None = None, abandon: Callable[[], bool] | None = None) -> float:
        """Join (or re-join) the group at rank 0's address:port; returns the seconds. `abandon()` True ends the wait
        (`RankLostError`)."""
        began, timeout = time.perf_counter(), timeout or self.timeout
        store, self._store = store or self._store, None
        self.leave()
        if ipaddress.ip_address(address).is_loopback:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own lookup of the host name may not be
        try:
            if store is None:  # every rank but rank 0: a client of rank 0's store
                store = dist.TCPStore(address, port, self.ranks, is_master=False,
                                      timeout=datetime.timedelta(seconds=timeout))
            self._arrive(store, local_address(address, port), timeout, abandon)
            dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.ranks,
                                    timeout=datetime.timedelta(seconds=timeout))
            self.peers = {r: _address(store.get(f"zocheck/live/{r}").decode())
                          for r in range(self.ranks) if r != self.rank}
        except (RuntimeError, OSError) as exc:  # rank 0's store gone, or a rank that never came
            if isinstance(exc, RankLostError):
                raise
            raise RankLostError(f"rank {self.rank}: could not join the group at {address}:{port} "
                                f"({str(exc).splitlines()[0]})") from exc
        self.key = (address, port)
        self.generation += 1
        return time.perf_counter() - began

    def _arrive(self, store: dist.TCPStore, host: str, timeout: float, abandon: Callable[[], bool] | None) -> None:
        store.set(f"zocheck/live/{self.rank}", f"{host}:{liveness_port()}")
        store.add("zocheck/arrived", 1)
        deadline = time.monotonic() + timeout
        while store.add("zocheck/arrived", 0) < self.ranks:
            if abandon is not None and abandon():
                raise RankLostError(f"rank {self.rank}: a newer group was planned before every rank arrived")
            if time.monotonic() > deadline:
                raise RankLostError(f"rank {self.rank}: not every rank arrived within {timeout:g} s")
            time.sleep(ARRIVAL_POLL_SECONDS)

    def lost_peers(self, timeout: float = PROBE_SECONDS) -> list[int]:
        """The other ranks whose process is gone (or node silent), looked for until `timeout`, since a dying
        process's socket may still accept for a moment."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            gone = [r for r, address in sorted(self.peers.items()) if not alive(address, max(left, 0.05))]
            if gone or left <= 0:
                return gone
            time.sleep(ARRIVAL_POLL_SECONDS)

    def leave(self) -> None:
        if dist.is_initialized():
            work, self._work = self._work, None
            if work is not None and not work.is_completed():
                _set_aside(dist.group.WORLD, work)
            try:
                dist.destroy_process_group()
            except Exception:  # a group broken by a dead peer may not shut down cleanly; it is gone either way
                pass

    def gather(self, local: tuple[float, ...], abandon: Callable[[], bool] | None = None
               ) -> list[tuple[float, ...]]:
        """Every rank's `local` numbers (float64), in rank order; `abandon()` True ends the wait."""
        if not dist.is_initialized():
            raise RankLostError(f"rank {self.rank} is not in a process group (it was left after a failure)")
        mine = torch.tensor(local, dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(self.ranks)]
        try:
            self._work = dist.all_gather(out, mine, async_op=True)
            self._wait(abandon)
        except RuntimeError as exc:
            if isinstance(exc, RankLostError):
                raise
            raise RankLostError(f"rank {self.rank}: the all-gather failed ({str(exc).splitlines()[0]})") from exc
        self._work = None
        return [tuple(t.tolist()) for t in out]

    def _wait(self, abandon: Callable[[], bool] | None) -> None:
        if abandon is None:
            self._work.wait()
            return
        while True:
            try:
                self._work.wait(timeout=datetime.timedelta(seconds=ABANDON_POLL_SECONDS))
                return
            except RuntimeError:
                if self._work.is_completed():  # the exchange itself failed
                    raise
            if abandon():
                raise GroupAbandoned(f"rank {self.rank}: a newer group was planned during the exchange")


def _set_aside(group, work) -> None:
    """Hold a left group whose exchange is stuck: its destruction waits for gloo's timeout, so in a thread."""
    def hold(group, work) -> None:
        while not work.is_completed():
            time.sleep(1.0)

    threading.Thread(target=hold, args=(group, work), name="zocheck-abandoned-group", daemon=True).start()


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)
