"""The tests' one conftest: shared fixtures and the `slow` marker.

    tests/unit/          no Ray and no S3 endpoint: the core, the shadow's stages in-process, policies,
                         workloads, the benchmarks' pure parts, the repository's files
    tests/integration/   real Ray (local instances, multi-node `Cluster`s, `ray job submit`) and a
                         real S3 endpoint on 127.0.0.1 (moto's server, as s3fs's own suite uses)

Fixtures: `local_ray` (the local Ray instance a test process shares among its modules),
`without_local_ray`, `s3_endpoint`, `private_s3`, `s3_bucket`, `root` (an empty run root on local
disk and on S3), `no_matplotlib`, `small_disk` (a real 4 MiB filesystem to fill), `one_torch_thread`
(a module of tiny models, in process). Helpers (`support.py`, `reference_runs.py`, `kernel_cases.py`,
`normality.py`, and `module_seconds.py`: the order the modules go out in) lie beside this file,
which puts `tests/` on every test's path. The `slow` marker goes on the tests that take more than
a few seconds (`pytest -m "not slow"`), set where a test or its module is defined, or by the
fixtures it uses (`slow_fixture`: `local_ray` is one); `make check-slow-marks` names the unmarked
tests over 30 s.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import uuid

import pytest
import torch
from hypothesis import settings as hypothesis_settings

# Property tests draw the same examples on every run (a CI run passes or fails on the code, not on the draw);
# `HYPOTHESIS_PROFILE=explore` draws new ones on every run, to look for cases to add as `@example`s.
hypothesis_settings.register_profile("repeatable", derandomize=True)
hypothesis_settings.register_profile("explore", derandomize=False)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

try:
    import module_seconds  # beside this file; absent where a test copies this conftest elsewhere (pytester)
except ModuleNotFoundError:
    module_seconds = None

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one test process per core: a second torch thread in each would only contend
    # for the other's core (and for its Ray actors'), and tiny models' operators wait on each other.
    torch.set_num_threads(1)


def slow_fixture(*args, **kwargs):  # (fn) or (**pytest.fixture's keywords)
    """`pytest.fixture` for a fixture that makes every test using it slow (a Ray instance, a benchmark run):
    the tests of its module that use it are marked `slow`, so a new test that uses it is marked too.
    A slow test that uses no such fixture carries `@pytest.mark.slow` (or its module, `pytestmark`)."""

    def declare(fn):
        fixture = pytest.fixture(**kwargs)(fn)
        fixture.makes_tests_slow = True  # read by pytest_collection_modifyitems, in the test's module
        return fixture

    if len(args) == 1 and callable(args[0]) and not kwargs:  # @slow_fixture, without arguments
        return declare(args[0])
    return declare


INTEGRATION_FIXTURES = {"local_ray", "s3_endpoint", "private_s3", "s3_bucket", "root"}
"""Fixtures that start real Ray or a real S3 endpoint: only tests/integration/ uses them."""


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        needs = INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ()))
        if item.path.parent.name == "unit" and needs:
            raise pytest.UsageError(f"{item.nodeid} uses {', '.join(sorted(needs))} (real Ray or S3): "
                                    "it belongs in tests/integration/")
        if any(_makes_slow(item, name) for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if module_seconds is not None:
        items[:] = module_seconds.order(items, module_seconds.load())  # the longest modules first (make test)
    _SHARED_RAY.collected(items)


def _makes_slow(item, name: str) -> bool:
    """Whether fixture `name`, as `item` uses it (its module's, or the conftest's), is a `slow_fixture`."""
    if getattr(getattr(getattr(item, "module", None), name, None), "makes_tests_slow", False):
        return True
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.get(name, ()) if info is not None else ()
    return any(getattr(d.func, "makes_tests_slow", False) for d in definitions)


# `--max-unmarked-seconds S` (`make check-slow-marks`): the session fails when a test that is not marked
# slow took more than S seconds, its setup (the fixtures it started first) and teardown included. Only
# when asked: how long a test takes depends on the machine, so `make test` never judges it.


def pytest_addoption(parser):
    parser.addoption("--max-unmarked-seconds", type=float, default=None, metavar="S",
                     help="fail when a test not marked slow takes more than S seconds (setup and teardown "
                          "included); measure on a warm numba cache")
    parser.addoption("--fail-on-left-behind", action="store_true",
                     help="fail the session when a process the tests started outlives it (always named and "
                          "stopped)")
    parser.addoption("--exit-ceiling-seconds", type=float, default=30.0, metavar="S",
                     help="how long the processes the tests started may take to exit once the session ends "
                          "(a bound for a loaded machine); those left then are named and stopped")


class UnmarkedSeconds:
    """Adds up the seconds of each test not marked slow; names those over the limit and fails the session."""

    def __init__(self, limit: float):
        self.limit = limit
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        if "slow" not in report.keywords:
            self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def over(self) -> dict[str, float]:
        return {node: seconds for node, seconds in self.seconds.items() if seconds > self.limit}

    def pytest_sessionfinish(self, session, exitstatus):
        if self.over() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        if self.over():
            terminalreporter.section(f"tests not marked slow that took more than {self.limit:g} s", red=True)
            for node, seconds in sorted(self.over().items(), key=lambda kv: -kv[1]):
                terminalreporter.write_line(f"{seconds:8.2f} s  {node}  (mark it slow, or its slow fixture)")


# Nothing a test starts outlives the session: every process started under it (the test processes, Ray's
# raylets, workers and agents, drivers of the command line) inherits SESSION_ENV from the outermost pytest
# process, which, once the session ends, names those still running and stops them; with
# `--fail-on-left-behind` the session fails too. (Ray's agents retitle themselves and do not inherit the RAY_
# variables: found by neither, they outlived the clusters of two modules, half a core busy for the rest of a
# run. `make test` reports and stops what is left; it will fail on it once full runs have shown none left.)

SESSION_ENV = "ZOCHECK_TEST_SESSION"


class LeftBehind:
    """Stops and names the processes of this session that outlived it (and fails it, when asked)."""

    def __init__(self, marker: str, ceiling: float, fail: bool):
        self.marker = f"{SESSION_ENV}={marker}"
        self.ceiling = ceiling
        self.fail = fail
        self.left: dict[int, str] = {}

    @pytest.hookimpl(trylast=True)  # after xdist has stopped its workers
    def pytest_sessionfinish(self, session, exitstatus):
        deadline = time.monotonic() + self.ceiling
        while (left := processes_naming(self.marker)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    self.left[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
            except OSError:
                continue
        stop_processes_naming(self.marker)
        if self.left and self.fail and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        if self.left:
            terminalreporter.section("processes the tests started and left running (stopped now)", red=True)
            for pid, command in sorted(self.left.items()):
                terminalreporter.write_line(f"{pid:8d}  {command}")


def pytest_configure(config):
    limit = config.getoption("max_unmarked_seconds")
    if limit is not None and not hasattr(config, "workerinput"):  # judged where every test's report arrives
        config.pluginmanager.register(UnmarkedSeconds(limit), "unmarked-seconds")
    if SESSION_ENV not in os.environ:  # the outermost session (not an xdist worker, nor a session a test runs)
        os.environ[SESSION_ENV] = uuid.uuid4().hex
        ceiling = config.getoption("exit_ceiling_seconds")
        fail = config.getoption("fail_on_left_behind")
        config.pluginmanager.register(LeftBehind(os.environ[SESSION_ENV], ceiling, fail), "left-behind")


# ------------------------------------------------------------------------------------------ Ray


LOCAL_RAY_CPUS = 3
"""The logical CPUs of the local Ray instance where no module asks for more (`RAY_CPUS`)."""


class SharedLocalRay:
    """The local Ray instance a test process shares among its modules that use `local_ray`.

    Starting one costs about 5 s and 7 CPU-s (its GCS, raylet and agents); a test process of `make test`
    runs about five such modules. It starts at the first of them with the most CPUs any collected module
    asks for (`RAY_CPUS`), lives while the modules after it need it or need no Ray at all (tests/unit/),
    and is shut down before an integration module that starts Ray its own way (a multi-node `Cluster`, a
    system config of its own, a `ray start` node its drivers join) and at the end of the session."""

    def __init__(self):
        self.started = False
        self.modules: set[str] = set()
        """The modules with a test that uses `local_ray`."""
        self.cpus = LOCAL_RAY_CPUS

    def collected(self, items) -> None:
        for item in items:
            if "local_ray" in getattr(item, "fixturenames", ()):
                self.modules.add(item.nodeid.split("::")[0])
                self.cpus = max(self.cpus, getattr(item.module, "RAY_CPUS", LOCAL_RAY_CPUS))

    def start(self) -> None:
        import ray

        if self.started and ray.is_initialized():
            return
        self.stop()
        ray.init(address="local", num_cpus=self.cpus, namespace="zocheck", include_dashboard=False,
                 log_to_driver=False, dashboard_port=free_port())  # never the default, which another Ray may hold
        self.started = True

    def before(self, item) -> None:
        """Before `item` runs: start the instance where `item` uses it (a test of its module may have stopped
        it: `without_local_ray`), stop it where `item`'s module may start Ray its own way."""
        if "local_ray" in getattr(item, "fixturenames", ()):
            self.start()
        elif item.path.parent.name == "integration" and item.nodeid.split("::")[0] not in self.modules:
            self.stop()

    def stop(self) -> None:
        if self.started:
            import ray

            ray.shutdown()
            self.started = False


_SHARED_RAY = SharedLocalRay()


@pytest.hookimpl(tryfirst=True)  # before the item's fixtures
def pytest_runtest_setup(item):
    _SHARED_RAY.before(item)


def pytest_sessionfinish(session, exitstatus):
    _SHARED_RAY.stop()


@slow_fixture(scope="module")
def local_ray():
    """The local Ray instance (`SharedLocalRay`, started before each test that uses it), with at least the
    module's `RAY_CPUS` logical CPUs (3 unless it sets another), for all of its tests; a module whose every
    test needs it says `pytestmark = pytest.mark.usefixtures("local_ray")`. `address="local"` starts a new
    instance even where another `ray start` cluster runs on this machine. Multi-node clusters:
    `support.multi_node_cluster`."""
    yield


@pytest.fixture
def without_local_ray():
    """No Ray instance in this test process (the shared one is stopped): for a test that shows something
    happens before Ray starts."""
    import ray

    _SHARED_RAY.stop()
    assert not ray.is_initialized()
    yield


# ------------------------------------------------------------------------------------------- S3

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
    """Processes whose command line, environment or open files name `marker` (a Ray cluster's temp dir, or a
    variable set only for it: its own processes, those that retitle themselves and those that outlive their
    parent included). A retitled Ray agent (`ray::DashboardAgent`) writes its title over its environment as
    well, but keeps its log files under the cluster's temp dir open: left behind, it spends a core's third
    for about two minutes retrying to report its raylet's death."""
    found, needle = [], marker.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                named = needle in f.read()
            if not named:
                with open(f"/proc/{name}/environ", "rb") as f:
                    named = needle in f.read()
            if not named:
                named = any(marker in _link(f"/proc/{name}/fd/{fd}") for fd in os.listdir(f"/proc/{name}/fd"))
        except OSError:
            continue
        if named:
            found.append(int(name))
    return found


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed meanwhile
        return ""


CLUSTER_ENV = "ZOCHECK_TEST_CLUSTER"
"""Set, to its temp dir, in the environment of a cluster a test starts with `ray start`: every process of it
inherits it (Ray does not hand its RAY_ variables on to the agents a raylet starts, which retitle themselves),
so `stop_processes_naming(temp_dir)` finds them all."""


def stop_processes_naming(marker: str, ceiling: float = 30.0) -> None:
    """Stop the processes whose command line or environment names `marker`: a cluster a test started, and only
    that one (never a blanket `ray stop`, which stops every Ray instance of this user on the machine). Each
    round signals every process found then, so one started while the others stop (a raylet starts its agents
    a moment after itself) is stopped too: SIGTERM for 5 s, then SIGKILL, until none is left (`ceiling`
    bounds it on a loaded machine)."""
    started = time.monotonic()
    while found := processes_naming(marker):
        elapsed = time.monotonic() - started
        if elapsed > ceiling:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGTERM if elapsed < 5.0 else signal.SIGKILL)
            except ProcessLookupError:
                pass
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


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    """(URL, storage_options) of an empty storage root: once on local disk, once in a fresh S3 bucket."""
    if request.param == "local":
        return str(tmp_path / "run"), None
    return request.getfixturevalue("s3_bucket")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of tiny models: two threads contending with the shadow's threads and
    the other test process for two cores made each forward pass several times slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_matplotlib(monkeypatch):
    """matplotlib made unimportable for the test, as on an install without the `bench` extra."""
    import sys

    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith(("matplotlib.", "mpl_toolkits"))]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError


# ------------------------------------------------------------------------------------------- a full disk


class SmallDisk:
    """A real filesystem of `size` bytes (tmpfs) mounted at `path`, and a ballast file to fill it with."""

    def __init__(self, path, size: int):
        self.path, self.size = path, size
        self.ballast = path / ".ballast"

    def free_bytes(self) -> int:
        stats = os.statvfs(self.path)
        return stats.f_bavail * stats.f_frsize

    def fill(self, leave: int) -> None:
        """Write the ballast until at most `leave` bytes are free (a real ENOSPC for anything larger)."""
        with open(self.ballast, "ab", buffering=0) as f:
            while (room := self.free_bytes() - leave) > 0:
                f.write(b"\0" * min(room, 1 << 20))

    def free(self) -> None:
        self.ballast.unlink()


@pytest.fixture
def small_disk(tmp_path):
    """A `SmallDisk` of 4 MiB at tmp_path/disk, unmounted afterwards. Mounting needs CAP_SYS_ADMIN (root, as
    in CI's container): elsewhere the tests that need a real full filesystem are skipped."""
    import subprocess

    path = tmp_path / "disk"
    path.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "zocheck-full-disk", str(path)],
                                 capture_output=True, text=True)
    except FileNotFoundError as exc:
        pytest.skip(f"a small filesystem cannot be mounted here: {exc}")
    if mounted.returncode != 0:
        pytest.skip(f"a small filesystem cannot be mounted here: {mounted.stderr.strip()}")
    try:
        yield SmallDisk(path, 4 << 20)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
