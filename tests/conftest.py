"""Shared fixtures: a real S3 endpoint on 127.0.0.1 (moto's server, as s3fs's own suite uses);
the `slow` marker on the tests that take more than a few seconds (`pytest -m "not slow"`)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import uuid

import pytest

SLOW_TESTS: dict[str, str | set[str]] = {
    # module: "*" (all of its tests), or the names of its slow tests and of the fixtures that make a test slow
    "test_job_submit.py": "*",  # a `ray start --head` node and two submitted jobs
    "test_ray_host_failure.py": "*",  # multi-node clusters, node loss, rebuilds from durable storage
    "test_ray_recovery.py": "*",  # jobs on a real Ray instance with injected failures
    "test_ray_shadow_faults.py": "*",  # jobs with a killed shadow and S3 outages, then verified
    "test_data_parallel.py": "*",  # k trainer ranks on a real Ray instance, ranks killed
    "test_data_parallel_nodes.py": "*",  # a 3-node cluster, a rank's node removed
    "test_shadow_pipeline.py": {"test_a_storage_outage_is_reported_retried_and_leaves_no_gap"},  # S3 retries
    "test_triton_kernels.py": "*",  # kernels run by Triton's CPU interpreter
    "test_bench_overhead_recovery.py": "*",  # the overhead and recovery benchmarks on a real Ray instance
    "test_bench_data_parallel.py": {"local_ray"},  # a k=1 and a k=2 run, each losing a rank
    "test_train_cli.py": {"local_ray"},  # the embedded default job on Ray
    "test_tune.py": {"results"},  # a two-trial sweep with a restored trial
    "test_bench_eval.py": {"waste_doc", "scaling_doc", "memory_doc"},  # three benchmarks at a small scale
    "test_workload_training.py": {"test_zo_fine_tuning_lowers_held_out_loss", "test_a_task_run_is_reproducible"},
    "test_core_exactness.py": {"test_trainer_reference_and_fused_replay_agree_on_a_hf_model",
                               "test_odd_tensor_shapes"},  # HF models in every dtype; the fp16 kernels' compile
    "test_storage_crash.py": {"test_sigkill_during_saves_never_exposes_a_torn_snapshot"},  # 12 killed writers
}
"""The tests marked `slow`, by module: measured at more than a few seconds on two cores (with the
fixtures they start). `pytest -m "not slow"` runs the rest in a fraction of the time."""


def is_slow(module: str, test_name: str, fixture_names) -> bool:
    names = SLOW_TESTS.get(module)
    return names == "*" or bool(names and (test_name in names or names & set(fixture_names)))


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_slow(item.path.name, getattr(item, "originalname", item.name), getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# Nothing may reach real AWS: dummy credentials and no instance-metadata lookups.
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now: every socket is held open until all are chosen (a port
    released by one call is often the next one the kernel hands out, so one call at a time can repeat)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            sockets.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def processes_naming(marker: str) -> list[int]:
    """Processes whose command line names `marker` (a Ray cluster's temp dir: its own processes)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(name))
        except OSError:
            pass
    return found


def stop_processes_naming(marker: str) -> None:
    """Stop the processes whose command line names `marker`: a cluster a test started, and only that one
    (never a blanket `ray stop`, which stops every Ray instance of this user on the machine)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        for pid in processes_naming(marker):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while processes_naming(marker) and time.monotonic() < deadline:
            time.sleep(0.1)


class MotoS3:
    """A moto S3 server on 127.0.0.1 that can be stopped and restarted on the same port.

    Buckets and objects live in the process (moto's backends), so they survive a restart,
    as they would survive an outage of a real endpoint.
    """

    def __init__(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._server = None
        self.start()

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def options(self, **extra) -> dict:
        """s3fs storage_options reaching this endpoint; retries kept short so failures are quick."""
        return {
            "endpoint_url": self.endpoint_url, "key": "testing", "secret": "testing",
            "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 2,
                              "read_timeout": 20},
            **extra,
        }

    def new_bucket(self) -> str:
        import s3fs

        name = f"zocheck-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(skip_instance_cache=True, **self.options()).mkdir(name)
        return name


@pytest.fixture(scope="session")
def aws_env():
    saved = {k: os.environ.get(k) for k in _AWS_ENV}
    os.environ.update(_AWS_ENV)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def s3_endpoint(aws_env):
    """One moto S3 server for the session (tests that stop a server start their own)."""
    server = MotoS3()
    yield server
    server.stop()


@pytest.fixture
def private_s3(aws_env):
    """A moto S3 server of the test's own, for tests that stop and restart it."""
    server = MotoS3()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint):
    """`(s3://bucket/run URL, storage_options)` in a fresh bucket."""
    return f"s3://{s3_endpoint.new_bucket()}/run", s3_endpoint.options()


@pytest.fixture
def no_matplotlib(monkeypatch):
    """matplotlib made unimportable for the test, as on an install without the `bench` extra."""
    import sys

    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith(("matplotlib.", "mpl_toolkits"))]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
