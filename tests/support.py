"""Helpers the tests share (`tests/` is on the path of every test, as the conftest's directory).

    from support import REPO, PausableS3, encode, multi_node_cluster, trained, wait_until

The fixtures are in `conftest.py`; the uninterrupted reference runs every recovered run is
compared with are in `reference_runs.py`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
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


def stop_driver(driver: subprocess.Popen) -> None:
    """SIGINT a driver process still running (its clean stop), then kill it if it has not ended in 120 s."""
    if driver.poll() is None:
        driver.send_signal(signal.SIGINT)
        try:
            driver.wait(timeout=120)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()


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
def multi_node_cluster(*node_cpus: int, system_config: dict | None = None, dashboard_port: int | None = None):
    """A `ray.cluster_utils.Cluster` on this machine: a head without CPUs (so nothing is scheduled on a
    node a test cannot remove) and one node per entry of `node_cpus`, this process its driver; its
    dashboard's port a free one unless given. Yields (cluster, nodes); shut down on leaving."""
    import ray
    from ray.cluster_utils import Cluster

    from zocheck_ray.actors.names import NAMESPACE

    from conftest import free_port

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "dashboard_port": dashboard_port or free_port(),
                                                            "_system_config": system_config or {}})
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


class PausableS3:
    """A moto S3 server in a process of its own, reached through a proxy that can pause it: while paused,
    connections are accepted and nothing is answered (the server never sees what they send). `resume()`
    resets every connection the pause held, as a partition that ends with resets does: a request sent
    while paused never reaches the server, so nothing written after the pause becomes durable later
    (a paused server process would run every request it had buffered once it went on, even those of a
    process killed meanwhile)."""

    def __init__(self):
        from conftest import free_port

        self._upstream = free_port()
        self.process = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"),
                                         "-H", "127.0.0.1", "-p", str(self._upstream)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._paused = self._closed = False
        self._pairs: list[list[socket.socket]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def pause(self) -> None:
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        """Reset what the pause held (open connections, and those waiting to be accepted), then serve again."""
        with self._lock:
            for pair in self._pairs:
                for sock in pair:
                    _close(sock)
            self._pairs = []
            self._listener.setblocking(False)
            try:
                while True:
                    _close(self._listener.accept()[0])
            except (BlockingIOError, OSError):
                pass
            self._listener.settimeout(0.05)
            self._paused = False

    def _accept(self) -> None:
        while not self._closed:
            if self._paused:
                time.sleep(0.01)
                continue
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, BlockingIOError, OSError):
                continue
            with self._lock:
                if self._paused:  # accepted as the pause began: it is held with the rest
                    self._pairs.append([client])
                    continue
                try:
                    upstream = socket.create_connection(("127.0.0.1", self._upstream))
                except OSError:
                    _close(client)
                    continue
                pair = [client, upstream]
                self._pairs.append(pair)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst, pair), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, pair: list) -> None:
        src.settimeout(0.05)
        try:
            while not self._closed:
                if self._paused:
                    time.sleep(0.01)
                    continue
                try:
                    data = src.recv(1 << 16)
                except TimeoutError:
                    continue
                while self._paused and pair in self._pairs:  # read as the pause began: held, then dropped
                    time.sleep(0.01)
                if not data or pair not in self._pairs:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in pair:
            _close(sock)

    def options(self) -> dict:
        return {"endpoint_url": self.endpoint_url, "key": "testing", "secret": "testing",
                "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 2,
                                  "read_timeout": 5}}

    def new_bucket(self) -> str:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.options())
        assert wait_until(lambda: _answers(fs), timeout=60)
        fs.mkdir("zocheck-paused")
        return "zocheck-paused"

    def close(self):
        self._closed = True
        self.resume()
        _close(self._listener)
        self.process.kill()
        self.process.wait()


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def _answers(fs) -> bool:
    try:
        fs.ls("")
        return True
    except Exception:
        return False
