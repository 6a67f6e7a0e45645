"""A per-node process template: the run's Ray workers (the trainer ranks and the shadow; with a
standby, the shadow alone: `control/placement.py`) are forked from a process that has torch and
transformers imported, so that a process Ray starts for them (a restart above all) is up in about
a second instead of after several CPU seconds of imports.

How. These actors' runtime environment names this file as their Python (`runtime_env`), so
Ray starts such a worker as `python template.py default_worker.py ARGS...` (after its own
`setup_worker.py`). This script, the *launcher*, imports only the standard library. It asks the
node's template, over a Unix socket in Linux's abstract namespace named by `template_key`, to fork a
worker for it, and hands over its arguments, environment, working directory, module path and
standard streams; the forked child runs Ray's `default_worker.py` as `__main__`, as a fresh
interpreter would. The launcher stays for the worker's life: it passes SIGTERM, SIGINT, SIGHUP and
SIGQUIT on to it and ends as the worker ends (its exit status, or killed by the same signal). A
worker whose launcher dies (a `kill -9` of the process Ray started) kills itself.

The first launcher on a node that finds no template starts one (binds the socket, detaches: a process
group of its own, init its parent) and waits for it instead of importing alone: the same work, once. The
template serves until the raylet it was started for exits. Its memory (the imported libraries,
about 0.6 GB) is shared copy-on-write with the workers it forks. In `ps` it shows the command line
of the launcher that started it (`template.py .../default_worker.py ...`, so `ray stop` ends it too);
it logs to `<session>/logs/zocheck-template-<pid>.log` in Ray's session directory.

What is shared must not differ from what a worker would have built itself:
- the template imports only modules (`PRELOAD`) whose state depends on nothing but the interpreter,
  its module path and the environment variables named by `KEY_PREFIXES`, all of which are in the
  key: a launcher whose environment differs there has a template of its own;
- no threads: a template with more than one thread after its imports (an OpenMP pool, say) refuses
  to fork, and its launchers start their workers the usual way;
- a forked worker reseeds Python's and numpy's global generators, and the actor sets torch's
  intra-op threads from OMP_NUM_THREADS (`settle_threads`: OpenMP reads it when torch loads, and Ray
  sets it only in the worker, after the template loaded torch).

The template and the workers it forks stay in the session of the launcher that started the template (the
raylet's, as every worker Ray starts itself is), each in a process group of its own. Linux's scheduler, where
it groups processes by session (autogroup, on by default in most distributions' kernels), shares the CPUs
fairly among sessions first and by nice value only within one: a worker in a session of its own would take as
much CPU as all of Ray's other workers together, whatever its threads' nice values (`actors/priority.py`). So
it was: a 540M-parameter bf16 standby's promotion on two cores took 1.83 s beside the shadow forked into a
session of its own, whose nice-19 replay of the same record took as much CPU as the promotion did.

Any failure before the template has forked (no socket, a template that died or refused, no answer
in `ANSWER_SECONDS`) starts the worker as Ray would have: the launcher execs the interpreter on
Ray's arguments. Linux only (`available`); the job setting `process_template` turns it off.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # run as a script: this directory's modules must not shadow the standard library
    del sys.path[0]

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import selectors  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402
import time  # noqa: E402

PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.masking_utils",
           "transformers.activations", "transformers.generation", "safetensors.torch")
"""What the template imports: the bulk of a trainer process's start (about 4.5 of its 5 CPU seconds here; a
shadow's imports are a part of it).
`ZOCHECK_RAY_TEMPLATE_PRELOAD` (comma-separated module names) replaces it."""

PRELOAD_ENV = "ZOCHECK_RAY_TEMPLATE_PRELOAD"

KEY_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_",
                "NVIDIA_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "XDG_", "HOME", "TMPDIR",
                "VIRTUAL_ENV", "PATH", PRELOAD_ENV)
"""Environment variables that can change what an import of `PRELOAD` does: they are part of a template's key."""

FORKED_ENV = "ZOCHECK_RAY_TEMPLATE_PID"
"""Set in a forked worker's environment: the template it came from."""

ANSWER_SECONDS = 60.0
"""How long a launcher waits for its template to fork (a template still importing included) before it
starts its worker the usual way. Ray's own limit for a worker to register is 60 s."""

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def available() -> bool:
    """Whether this platform can run templates (Linux: abstract sockets, pidfds, descriptor passing)."""
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")


def runtime_env() -> dict:
    """The runtime environment that starts an actor's workers through this node's template."""
    return {"py_executable": f"{sys.executable} {os.path.abspath(__file__)}"}


def settle_threads() -> None:
    """In a worker forked from a template: torch's intra-op threads as OMP_NUM_THREADS would have set them had
    the worker loaded torch itself (Ray sets that variable in the worker, after the template loaded torch)."""
    if not os.environ.get(FORKED_ENV) or "torch" not in sys.modules:
        return
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        sys.modules["torch"].set_num_threads(int(value))


def template_key(env: dict[str, str], executable: str, path: list[str], raylet_pid: int) -> str:
    shown = {k: v for k, v in env.items() if k.startswith(KEY_PREFIXES)}
    text = json.dumps([executable, path, raylet_pid, sorted(shown.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def address(key: str) -> str:
    return f"\0zocheck-ray-template-{key}"


def _say(message: str) -> None:
    try:
        sys.stderr.write(f"zocheck-ray template [{os.getpid()}]: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


# ------------------------------------------------------------------------------------- messages


def _send(conn: socket.socket, payload: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(payload).encode()
    data = struct.pack("!I", len(data)) + data
    if fds:
        sent = socket.send_fds(conn, [data], fds)
        data = data[sent:]
    conn.sendall(data)


def _receive(conn: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message (None at the end of the stream) and the descriptors that came with it. It reads no byte of
    the next one (a worker's exit can follow the template's answer at once)."""
    first, fds, _, _ = socket.recv_fds(conn, 4, max_fds) if max_fds else (conn.recv(4), [], 0, None)
    rest = _read(conn, 4 - len(first)) if first else None
    body = None if rest is None else _read(conn, struct.unpack("!I", first + rest)[0])
    return (None if body is None else json.loads(body)), fds


def _read(conn: socket.socket, size: int) -> bytes | None:
    """Exactly `size` bytes (None where the stream ends first)."""
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


# ------------------------------------------------------------------------------------- launcher


def launch(argv: list[str]) -> None:
    """Start Ray's worker `argv` (default_worker.py and its arguments) through the node's template, or,
    where that fails before the fork, as Ray would have; returns never."""
    if available():
        try:
            conn = _connect(argv)
        except OSError as exc:
            _say(f"starting this worker the usual way: {exc}")
        else:
            try:
                pid = _request(conn, argv)
            except (OSError, ValueError) as exc:
                _say(f"starting this worker the usual way: {exc}")
                conn.close()
            else:
                _follow(conn, pid)  # returns never
    os.execv(sys.executable, [sys.executable, *argv])


def _connect(argv: list[str]) -> socket.socket:
    raylet = os.getppid()  # setup_worker.py, which the raylet started, execs (through bash) into this launcher
    name = address(template_key(dict(os.environ), sys.executable, sys.path, raylet))
    try:
        return _connected(name)
    except (ConnectionRefusedError, FileNotFoundError):
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(name)
    except OSError:  # another launcher's template took the name just now
        listener.close()
        return _connected(name)
    listener.listen(64)
    _start_template(listener, raylet, _log_path(argv))
    listener.close()
    return _connected(name)  # queued until the template, done importing, accepts


def _connected(name: str, uid: int | None = None) -> socket.socket:
    """A connection to the template at `name`, held by user `uid` (this process's)."""
    uid = os.getuid() if uid is None else uid
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(name)
        peer = peer_uid(conn)
        if peer != uid:  # the launcher hands over its environment (credentials among it): to its own user only
            raise PermissionError(f"the template's socket is held by uid {peer}, not this user's ({uid})")
    except OSError:
        conn.close()
        raise
    return conn


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (as the kernel saw it connect)."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def _log_path(argv: list[str]) -> str:
    options = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    logs = os.path.join(options.get("temp-dir", ""), options.get("session-name", ""), "logs")
    return os.path.join(logs, f"zocheck-template-{os.getpid()}.log") if os.path.isdir(logs) else os.devnull


def _start_template(listener: socket.socket, raylet: int, log_path: str) -> None:
    child = os.fork()
    if child:
        os.waitpid(child, 0)  # the intermediate process exits once the template is detached
        return
    # The intermediate process: a process group of its own, then the template as its child, then gone. (A worker
    # the template forks leaves through here by SystemExit, as from any interpreter's __main__.) The session stays
    # the launcher's: see the module's docstring.
    try:
        os.setpgid(0, 0)
        if os.fork():
            os._exit(0)
        _serve(listener, raylet, log_path)
    except Exception as exc:  # noqa: BLE001  (a template that cannot serve must not go on as the launcher)
        _say(f"the template failed: {exc!r}")
        os._exit(1)
    os._exit(0)


def _request(conn: socket.socket, argv: list[str]) -> int:
    """The pid of the worker the template forked (OSError where it refused or is gone)."""
    path = [os.path.dirname(os.path.abspath(argv[0])), *sys.path]  # as `python default_worker.py` has it
    conn.settimeout(ANSWER_SECONDS)
    _send(conn, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "path": path}, [0, 1, 2])
    answer, _ = _receive(conn)
    if answer is None:
        raise OSError("the template closed the connection")
    if "pid" not in answer:
        raise OSError(f"the template refused: {answer.get('refused')}")
    conn.settimeout(None)
    return int(answer["pid"])


def _follow(conn: socket.socket, pid: int) -> None:
    """Pass signals on to worker `pid` until it ends; then end as it did."""
    for sig in _SIGNALS:
        signal.signal(sig, lambda number, frame: _signal(pid, number))
    status = None
    try:
        answer, _ = _receive(conn)
        status = None if answer is None else answer.get("status")
    except OSError:
        pass
    if status is None:  # the template is gone: wait for the worker itself
        try:
            select.select([os.pidfd_open(pid)], [], [])  # readable once the worker has ended
        except ProcessLookupError:
            pass
        os._exit(1)  # its status went with the template
    if os.WIFSIGNALED(status):  # killed by a signal: so is its launcher, as Ray would see a worker die
        number = os.WTERMSIG(status)
        try:
            signal.signal(number, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL's cannot be set, nor need it be
            pass
        os.kill(os.getpid(), number)
        os._exit(128 + number)
    os._exit(os.waitstatus_to_exitcode(status))


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


# ------------------------------------------------------------------------------------- template


class _Template:
    def __init__(self, listener: socket.socket, raylet: int, uid: int | None = None):
        self.listener = listener
        self.uid = os.getuid() if uid is None else uid
        """The only user whose launchers it serves (the abstract namespace is open to every user of the host)."""
        self.raylet = os.pidfd_open(raylet)
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.raylet, selectors.EVENT_READ, "raylet")
        self.workers: dict[int, tuple[socket.socket, int]] = {}
        """Forked worker pid -> (its launcher's connection, its pidfd)."""

    def serve(self) -> None:
        while True:
            for selected, _ in self.selector.select():
                what = selected.data
                if what == "raylet":
                    return
                if what == "accept":
                    self._accept()
                elif what[0] == "exited":
                    self._reap(what[1])
                else:  # ("launcher", pid): its launcher is gone (or sent what it should not)
                    self._drop(what[1])

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        fds: list[int] = []
        try:
            conn.settimeout(10.0)
            peer = peer_uid(conn)
            if peer != self.uid:
                _send(conn, {"refused": f"uid {peer} is not the template's user ({self.uid})"})
                raise ValueError(f"refused a fork to uid {peer}")
            request, fds = _receive(conn, max_fds=3)
            if request is None or len(fds) != 3:
                raise ValueError("an incomplete request")
            threads = len(os.listdir("/proc/self/task"))
            if threads != 1:
                _send(conn, {"refused": f"the template runs {threads} threads: a fork would copy them stopped"})
                raise ValueError(f"refused a fork: {threads} threads")
            conn.settimeout(None)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                self._become_worker(conn, request, fds)  # returns never
            pidfd = os.pidfd_open(pid)
            self.workers[pid] = (conn, pidfd)
            self.selector.register(pidfd, selectors.EVENT_READ, ("exited", pid))
            self.selector.register(conn, selectors.EVENT_READ, ("launcher", pid))
            _send(conn, {"pid": pid})
        except (OSError, ValueError) as exc:
            _say(f"request not served: {exc}")
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)

    def _reap(self, pid: int) -> None:
        conn, pidfd = self.workers.pop(pid)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        try:
            self.selector.unregister(conn)
        except KeyError:  # its launcher is gone already (`_drop`)
            pass
        _, status = os.waitpid(pid, 0)
        try:
            _send(conn, {"status": status})
        except OSError:
            pass
        conn.close()

    def _drop(self, pid: int) -> None:
        """Its launcher is gone: so is the worker (it kills itself; this makes sure)."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        conn, _ = self.workers[pid]
        self.selector.unregister(conn)

    def _become_worker(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        """In the forked child: drop the template's descriptors, take the launcher's streams, environment,
        directory, arguments and path, and run Ray's worker as `__main__`."""
        try:
            self.selector.close()
            self.listener.close()
            os.close(self.raylet)
            for other, pidfd in self.workers.values():
                other.close()
                os.close(pidfd)
            os.setpgid(0, 0)  # out of the template's process group: what is signalled there is not this worker's
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            fds.clear()
            os.environ.clear()
            os.environ.update(request["env"])
            os.environ[FORKED_ENV] = str(os.getppid())
            os.chdir(request["cwd"])
            sys.argv[:] = request["argv"]
            sys.path[:] = request["path"]
            _reseed()
            _watch_launcher(conn)
        except BaseException as exc:  # noqa: BLE001
            _say(f"the forked worker could not start: {exc!r}")
            os._exit(1)
        import runpy

        runpy.run_path(sys.argv[0], run_name="__main__")
        raise SystemExit(0)  # out through main(): the interpreter's own shutdown (threads, atexit, streams)


def _reseed() -> None:
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _watch_launcher(conn: socket.socket) -> None:
    """Kill this worker once its launcher is gone (the process Ray started and would signal or kill)."""
    import threading

    def watch():
        try:
            while conn.recv(4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zocheck-ray-launcher", daemon=True).start()


def _serve(listener: socket.socket, raylet: int, log_path: str) -> None:
    """The detached template: its own streams and directory, the imports, then forks on request."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    keep = listener.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 65536)
    os.chdir("/")
    # Loaded as a worker of one CPU: Ray sets OMP_NUM_THREADS=1 in the trainer's workers (which reserve at most
    # one) before their imports, which OpenMP and numpy's BLAS read as they load (and start no pool then).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    began = time.process_time()
    import importlib

    preload = [n for n in os.environ.get(PRELOAD_ENV, ",".join(PRELOAD)).split(",") if n.strip()]
    for name in preload:
        try:
            importlib.import_module(name.strip())
        except ImportError as exc:
            _say(f"not preloaded: {name} ({exc})")
    _say(f"serving for raylet {raylet}: {len(sys.modules)} modules imported in {time.process_time() - began:.2f} "
         f"CPU-s ({', '.join(preload)})")
    _Template(listener, raylet).serve()
    _say(f"raylet {raylet} exited: the template ends")


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: template.py default_worker.py [ARGS...] (Ray's worker command)")
    launch(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
