"""The process template under Ray: the trainer's actors start forked from their node's template (torch
and transformers imported already), Ray's restart of a killed one too, and the job's settings and
runtime environment decide whether they do. tests/unit/test_template.py covers the launcher and the
template's protocol (signals, exits, a lost launcher or template) without Ray."""

import os
import signal
import sys

import pytest
import ray

from reference_runs import assert_exact, job_for, uninterrupted_hashes
from support import wait_until
from zocheck_ray.actors import template
from zocheck_ray.config import JobConfig
from zocheck_ray.control import RunCallback
from zocheck_ray.control.placement import shadow_runtime_env, trainer_runtime_env
from zocheck_ray.testing import run_with_faults

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray"),
              pytest.mark.skipif(not template.available(), reason="process templates need Linux")]


@ray.remote(num_cpus=0, max_restarts=1)
class Probe:
    """What a trainer's process looks like when its actor starts (before it imports anything itself)."""

    def __init__(self):
        self.preloaded = {name: name in sys.modules for name in ("torch", "transformers.modeling_utils")}
        template.settle_threads()  # as TrainerActor's constructor does

    def info(self) -> dict:
        import torch

        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = f.read().replace(b"\0", b" ").decode()
        return {"pid": os.getpid(), "ppid": os.getppid(), "parent": parent, **self.preloaded,
                "forked": os.environ.get(template.FORKED_ENV), "threads": torch.get_num_threads(),
                "omp": os.environ.get("OMP_NUM_THREADS"), "cwd": os.getcwd(), "path0": sys.path[0],
                "restarted": ray.get_runtime_context().was_current_actor_reconstructed, "session": os.getsid(0),
                # the scheduler's group, without its nice value; None where the kernel has no autogroups (the
                # file is missing, or empty where the kernel has them off)
                "autogroup": next(iter(open("/proc/self/autogroup").read().split()), None)
                if os.path.exists("/proc/self/autogroup") else None}


def test_trainer_processes_are_forked_from_their_nodes_template_and_so_is_a_restart():
    env = trainer_runtime_env(JobConfig())
    assert env == template.runtime_env()
    plain = ray.get(Probe.remote().info.remote())
    first = Probe.options(runtime_env=env).remote()
    one = ray.get(first.info.remote())
    assert plain["forked"] is None and not plain["torch"]  # Ray's own start: nothing imported
    assert one["forked"] == str(one["ppid"]) and "template.py" in one["parent"]
    assert one["torch"] and one["transformers.modeling_utils"]
    # as a worker Ray starts itself: OMP_NUM_THREADS's threads, the directory and the worker's own path first
    assert one["threads"] == int(one["omp"]) == plain["threads"]
    assert (one["cwd"], one["path0"]) == (plain["cwd"], plain["path0"])
    # and where the scheduler shares the CPUs by session, it shares them with Ray's other workers, not beside them
    assert (one["session"], one["autogroup"]) == (plain["session"], plain["autogroup"])
    os.kill(one["pid"], signal.SIGKILL)
    seen: list[dict] = []
    assert wait_until(lambda: _restarted(first, seen))  # Ray's restart of the killed process
    again = seen[-1]
    assert again["pid"] != one["pid"] and again["ppid"] == one["ppid"]  # forked from the same template
    assert again["torch"] and again["forked"] == one["forked"]


def _restarted(actor, seen: list) -> bool:
    try:
        info = ray.get(actor.info.remote(), timeout=60)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
    seen.append(info)
    return info["restarted"]


def test_the_job_turns_the_template_off_and_a_runtime_env_with_its_own_python_does():
    assert trainer_runtime_env(JobConfig(process_template=False)) is None
    assert shadow_runtime_env(JobConfig(process_template=False)) is None
    # with a standby, Ray starts the trainers itself (the template's path would take more CPU from a promotion)
    assert trainer_runtime_env(JobConfig(standby=True)) is None
    assert shadow_runtime_env(JobConfig(standby=True)) == template.runtime_env()

    @ray.remote(num_cpus=0)
    def inside():
        return trainer_runtime_env(JobConfig())

    assert ray.get(inside.options(runtime_env={"env_vars": {"A": "1"}}).remote()) == template.runtime_env()
    assert ray.get(inside.options(runtime_env={"py_executable": sys.executable}).remote()) is None


def parent_command(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        ppid = int(f.read().rpartition(")")[2].split()[1])
    with open(f"/proc/{ppid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


class Processes(RunCallback):
    """The pids of the trainer and the shadow at each segment's end, and the command of each one's parent."""

    def __init__(self):
        self.parents: dict[tuple[str, int], str] = {}

    def on_segment(self, run, segment) -> None:
        for role, actor in (("trainer", run.group.leader), ("shadow", run.shadow)):
            pid = ray.get(actor.pid.remote())
            self.parents.setdefault((role, pid), parent_command(pid))


def test_a_run_forks_its_trainer_its_restart_and_its_shadow_from_the_template_and_ends_exact(tmp_path):
    job = job_for(tmp_path)
    seen = Processes()
    summary = run_with_faults(job, fail_at=[10], progress=None, callbacks=[seen])
    assert_exact(summary, uninterrupted_hashes(job))
    trainers = [pid for role, pid in seen.parents if role == "trainer"]
    assert len(trainers) == 2  # the first process and Ray's restart of it
    assert all("template.py" in command for command in seen.parents.values()), seen.parents
