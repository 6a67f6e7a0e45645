"""`python3 -m zocheck_ray` started by a Python without zocheck-ray's dependencies hands over to Ray's.

A `ray job submit` entrypoint is a shell command run with the PATH of the process that ran
`ray start`. A cluster started as `.venv/bin/ray start --head` (the environment not
activated) has neither `zocheck-ray` nor the environment's `python` on that PATH: the
entrypoint finds the system's `python3`, which lacks torch and Ray. The raylet among the
entrypoint's ancestors knows the interpreter this node runs Ray's workers with (its
`--python_worker_command`), so `python3 -m zocheck_ray ...` re-runs itself there, once.

Standard library only: this runs where nothing else of zocheck-ray can be imported.
"""

from __future__ import annotations

import os
import shlex
import sys

HANDED_OVER = "ZOCHECK_RAY_HANDED_OVER_FROM"
"""Set in the environment of the re-run: names the interpreter that handed over, and stops a loop."""


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [arg.decode(errors="replace") for arg in f.read().split(b"\0") if arg]
    except OSError:
        return []


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])  # the command name may hold spaces
    except (OSError, IndexError, ValueError):
        return 0


def ray_node_python(pid: int | None = None) -> str | None:
    """The Python the raylet among `pid`'s ancestors (default: this process's) starts workers with."""
    pid = os.getppid() if pid is None else pid
    for _ in range(64):  # a job's driver sits a few levels below the raylet
        if pid <= 1:
            return None
        argv = _cmdline(pid)
        if argv and os.path.basename(argv[0]) == "raylet":
            for arg in argv:
                if arg.startswith("--python_worker_command="):
                    command = shlex.split(arg.split("=", 1)[1])
                    return command[0] if command else None
            return None
        pid = _parent(pid)
    return None


def hand_over_to_ray_python(missing: ModuleNotFoundError) -> None:
    """Re-run this `python -m zocheck_ray[.module] ...` under the Ray node's Python; return only where there is none.

    Called by `zocheck_ray/__init__.py` when run with `-m` and a dependency is missing.
    """
    python = ray_node_python()
    if python is None or os.environ.get(HANDED_OVER) or os.path.abspath(python) == os.path.abspath(sys.executable):
        note = (f"zocheck-ray's dependencies are not installed for {sys.executable}: run it with the Python of the "
                "environment that holds them (e.g. .venv/bin/python -m zocheck_ray)")
        if hasattr(missing, "add_note"):
            missing.add_note(note)
        return
    print(f"zocheck-ray: {sys.executable} lacks {missing.name!r}; running under this Ray node's Python, {python}",
          file=sys.stderr, flush=True)
    os.environ[HANDED_OVER] = sys.executable
    os.execv(python, [python, *sys.orig_argv[1:]])  # the same options, module and arguments
