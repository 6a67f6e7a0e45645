"""Set-up: the torch build matches the machine, and the environment holds only what it needs.

`make venv` installs the CPU build of torch where there is no CUDA device
(scripts/install_torch.sh) and pins it while the package and its extras install; these
tests check the environment they run in (CI runs them in a fresh clone's `.venv`).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from support import REPO

pytest_plugins = ["pytester"]



def machine_has_cuda_device() -> bool:
    """The rule scripts/install_torch.sh applies: `nvidia-smi -L` lists a device."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


HAS_CUDA_DEVICE = machine_has_cuda_device()


@pytest.mark.skipif(HAS_CUDA_DEVICE, reason="a CUDA device is present: the CUDA build is the right one")
def test_a_machine_without_cuda_runs_the_cpu_build_of_torch():
    assert torch.version.cuda is None, (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}) in {sys.prefix} on a machine without a CUDA device: "
        "set-up should have kept the CPU build (rm -rf .venv && make venv)")


@pytest.mark.skipif(HAS_CUDA_DEVICE, reason="a CUDA device is present: CUDA libraries belong there")
def test_a_machine_without_cuda_holds_no_nvidia_libraries():
    nvidia = sorted({d.metadata["Name"] for d in md.distributions() if (d.metadata["Name"] or "").startswith("nvidia-")})
    assert not nvidia, f"{len(nvidia)} NVIDIA wheels in {sys.prefix} on a machine without CUDA: {', '.join(nvidia)}"


@pytest.mark.skipif(not HAS_CUDA_DEVICE, reason="no CUDA device")
def test_a_machine_with_cuda_runs_a_cuda_build_of_torch():
    assert torch.version.cuda is not None and torch.cuda.is_available(), torch.__version__


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=~! ;]", r, maxsplit=1)[0] for r in requirements}


def test_plots_are_an_extra_not_a_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "matplotlib" not in names(project["dependencies"])
    assert "matplotlib" in names(project["optional-dependencies"]["bench"])
    assert "matplotlib" in names(project["optional-dependencies"]["test"])


def test_python_m_zocheck_ray_runs_the_command_line(monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(sys, "argv", ["zocheck_ray", "status", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("zocheck_ray", run_name="__main__")
    assert done.value.code == 0
    assert "usage: zocheck-ray status" in capsys.readouterr().out


def test_zocheck_ray_bench_is_the_benchmarks_command_line_in_a_checkout(capsys):
    from zocheck_ray.cli import main

    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "usage: zocheck-ray bench" in out and "data-parallel" in out and "storage" in out


def test_zocheck_ray_bench_outside_a_checkout_says_where_the_benchmarks_are(monkeypatch, tmp_path, capsys):
    from zocheck_ray import cli

    monkeypatch.setattr(cli, "CHECKOUT", tmp_path)  # an installed package: no benchmarks/ beside it
    assert cli.main(["bench", "replay", "--params", "1M"]) == 2
    error = capsys.readouterr().err
    assert "not installed with the package" in error and "python -m benchmarks" in error


def test_python_m_zocheck_ray_under_a_python_without_the_dependencies_says_what_to_do_in_one_line(tmp_path):
    # a `ray job submit` entrypoint's `python3` where the cluster was started outside the environment
    import venv

    venv.create(tmp_path / "bare", with_pip=False)  # a Python with the standard library only
    base = str(tmp_path / "bare" / "bin" / "python")
    lacks = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
    assert subprocess.run([base, "-c", lacks], capture_output=True, timeout=60).returncode == 0
    out = subprocess.run([base, "-m", "zocheck_ray", "train", "--steps", "3"], cwd=REPO, capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"zocheck-ray: {base} lacks 'torch', one of zocheck-ray's dependencies: ")
    for remedy in ("/path/to/.venv/bin/python -m zocheck_ray", "start the cluster from the activated environment",
                   "name that environment's Python in the entrypoint", 'runtime environment whose "pip" installs'):
        assert remedy in line


@pytest.mark.parametrize("arguments", [["--help"], ["train", "--set", "steps=-3"]])
def test_the_command_line_answers_help_and_a_bad_job_without_loading_torch(arguments):
    # the packages load their modules on first use (core/lazy.py), and `train` checks the job before the rest
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "zocheck_ray", *arguments], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    if arguments == ["--help"]:
        assert out.returncode == 0 and "usage: zocheck-ray" in out.stdout
    else:
        assert out.returncode == 2 and "zocheck-ray train:" in out.stderr and "steps" in out.stderr
    assert {"zocheck_ray.cli", "zocheck_ray.config"} <= imported
    heavy = {"torch", "numba", "transformers", "ray"} & imported
    assert not heavy, sorted(heavy)


def test_the_slow_marker_selects(pytester):
    # in this process: pytest's own collection with the suite's conftest, modules already imported
    files = [str(REPO / "tests" / name) for name in ("integration/test_tune.py", "integration/test_job_submit.py",
                                                     "unit/test_setup.py", "unit/test_core_exactness.py")]

    def collected(expression: str) -> set[str]:
        items, recorder = pytester.inline_genitems("-m", expression, "-p", "no:cacheprovider", "--rootdir",
                                                   str(REPO), *files)
        deselected = {id(item) for call in recorder.getcalls("pytest_deselected") for item in call.items}
        return {f"{item.path.name}::{item.name}" for item in items if id(item) not in deselected}

    slow, quick = collected("slow"), collected("not slow")
    assert "test_job_submit.py::test_status_of_an_unknown_run_is_a_clear_error" in slow
    assert "test_tune.py::test_restored_trial_resumes_exactly" in slow
    assert "test_tune.py::test_grid_option_parses_values_as_yaml" in quick
    assert "test_setup.py::test_free_ports_are_distinct" in quick
    assert "test_core_exactness.py::test_other_architectures_replay_exactly[tiny-llama]" in slow
    assert "test_core_exactness.py::test_public_api_is_exported" in quick
    assert slow and quick and not slow & quick


SLOW_MARKS_CASE = """
import time
import pytest
from conftest import slow_fixture

@slow_fixture
def cluster():
    return "started"

def test_sleeps():
    time.sleep(0.01)

@pytest.mark.slow
def test_marked_sleeps():
    time.sleep(0.01)

def test_with_a_slow_fixture(cluster):
    time.sleep(0.01)
"""


def test_the_unmarked_slow_check_names_only_unmarked_tests_and_only_when_asked(pytester):
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_case=SLOW_MARKS_CASE)
    # each test sleeps 0.01 s, at least: over a 0.001 s limit on any machine
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--max-unmarked-seconds", "0.001")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=3)
    named = [line for line in result.outlines if "(mark it slow, or its slow fixture)" in line]
    assert len(named) == 1 and "test_case.py::test_sleeps " in named[0], result.outlines
    assert pytester.runpytest_inprocess("-p", "no:cacheprovider").ret == pytest.ExitCode.OK
    selected = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "not slow")
    selected.assert_outcomes(passed=1, deselected=2)


def test_free_ports_are_distinct():
    # a port released by one lookup is often the kernel's next answer: all of a call's sockets are held at once
    from conftest import free_ports

    for _ in range(20):
        ports = free_ports(9)  # as many as a `ray start --head` takes
        assert len(set(ports)) == 9 and all(0 < p < 65536 for p in ports)


_LOAD_EVERY_KERNEL = """
import torch
from zocheck_ray.core import ZOConfig, fused
fused.load_kernels(fused.KERNELS)
for optimizer in ("zo-sgd", "zo-adam", "sparse-mezo"):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for steps in (1, 3):
            fused.warm_up(dtype, ZOConfig(optimizer=optimizer), steps=steps)
kernels = [k for k in vars(fused).values() if hasattr(k, "stats") and hasattr(k, "py_func")]
print(fused.__file__, len(fused.KERNELS), sum(sum(k.stats.cache_hits.values()) for k in kernels),
      sum(sum(k.stats.cache_misses.values()) for k in kernels))
"""


def load_every_kernel(**run) -> tuple[str, int, int, int]:
    """(fused.py's path, kernels, cache hits, cache misses) of a new process that replays with every kernel."""
    done = subprocess.run([sys.executable, "-c", _LOAD_EVERY_KERNEL], capture_output=True, text=True, timeout=600,
                          **run)
    assert done.returncode == 0, done.stderr
    path, kernels, hits, misses = done.stdout.split()
    return path, int(kernels), int(hits), int(misses)


@pytest.fixture(scope="module")
def compiled():
    """Every kernel in numba's cache, as `make test` leaves it (compiled here when the module runs alone)."""
    from zocheck_ray.core.fused import compile_kernels

    compile_kernels()


def test_compiled_kernels_are_only_loaded_afterwards(compiled):
    # `make test` compiles every kernel once, before the tests; a process started afterwards (a test's,
    # a Ray actor's) finds each in numba's cache, whatever dtype, optimizer or batch it replays
    _, kernels, hits, misses = load_every_kernel()
    assert hits == kernels and misses == 0  # each loaded once, none compiled


@pytest.mark.parametrize("workers", [1, 2, 3, 6])
def test_compile_kernels_gives_its_processes_equal_shares_and_the_generator_first(workers):
    from zocheck_ray.core.fused import COMPILE_CPU_SECONDS, KERNELS, split_kernels

    shares = split_kernels(workers)
    assert sorted(n for share in shares for n in share) == sorted(KERNELS)  # each kernel once
    assert len(shares) == workers
    seconds = [sum(COMPILE_CPU_SECONDS[n] for n in share) for share in shares]
    # no process waits on another for longer than the longest single kernel takes
    assert max(seconds) - min(seconds) <= max(COMPILE_CPU_SECONDS.values())
    # the generator leads its share: the others' warm-ups (replay first) then find it compiled
    (generator,) = [share for share in shares if "perturbation" in share]
    assert generator[0] == "perturbation"


_LOAD_THE_GENERATOR = """
from zocheck_ray.core import fused
fused.load_kernels(["perturbation"])
stats = fused._perturbation_kernel.stats
print(sum(stats.cache_hits.values()), sum(stats.cache_misses.values()))
"""


@pytest.mark.slow  # one kernel compiled (the smallest)
def test_a_process_caches_the_kernels_in_numba_cache_dir_and_the_next_only_loads_them(tmp_path):
    # numba's documented setting, which every process of a run gets: the first compiles into it, the next loads
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    hits_and_misses = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _LOAD_THE_GENERATOR], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr
        hits_and_misses.append(tuple(int(n) for n in done.stdout.split()))
    assert hits_and_misses == [(0, 1), (1, 0)]  # compiled once, then loaded
    assert list((tmp_path / "numba").rglob("*.nbi")) and list((tmp_path / "numba").rglob("*.nbc"))


@pytest.mark.parametrize("chosen", [False, True])
def test_numba_caches_in_the_packages_directory_unless_the_user_chose_one(tmp_path, chosen):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    if chosen:
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "mine")
    code = ("import json, zocheck_ray, numba; from zocheck_ray.core.kernel_cache import cache_env; "
            "print(json.dumps([numba.config.CACHE_DIR, cache_env()]))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    cache_dir, actor_env = json.loads(done.stdout)
    if chosen:  # the user's, handed to the actors (a worker's environment is its node's)
        assert cache_dir == str(tmp_path / "mine") and actor_env == {"NUMBA_CACHE_DIR": cache_dir}
    else:  # the package's, which each worker sets for itself
        assert cache_dir == str(tmp_path / "xdg" / "zocheck-ray" / "numba") and actor_env == {}


LEAVES_A_PROCESS = """
import subprocess

def test_starts_a_process_and_forgets_it():
    subprocess.Popen(["sleep", "600"])
"""


def test_a_process_a_test_leaves_running_is_named_and_stopped_and_fails_the_session_when_asked(pytester, monkeypatch):
    from conftest import SESSION_ENV, processes_naming

    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_case=LEAVES_A_PROCESS)
    monkeypatch.delenv(SESSION_ENV)  # the session below is an outermost one, with a marker of its own
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--exit-ceiling-seconds", "0.5",
                                           "--fail-on-left-behind")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1)
    section = result.outlines.index(next(line for line in result.outlines if "left running" in line))
    named = [line.split() for line in result.outlines[section + 1:] if line.strip()][0]
    assert named[1:] == ["sleep", "600"]  # its pid and command line
    assert not os.path.exists(f"/proc/{named[0]}") or "sleep" not in Path(f"/proc/{named[0]}/cmdline").read_text()
    assert not processes_naming("sleep\0600")
    reported = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--exit-ceiling-seconds", "0.5")
    assert reported.ret == pytest.ExitCode.OK  # without the option: named and stopped, not failed
    assert any("left running" in line for line in reported.outlines) and not processes_naming("sleep\0600")


def test_a_process_that_names_a_cluster_only_through_its_open_files_is_found_and_stopped(tmp_path):
    # a retitled Ray agent: its command line and environment (overwritten by its title) do not name the
    # cluster's temp dir, the log files it holds open there do
    from conftest import processes_naming, stop_processes_naming

    marker = str(tmp_path / "cluster")
    os.makedirs(marker)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.stdin.readline().strip(), 'w'); "
                               "print('open', flush=True); time.sleep(600)"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={k: v for k, v in os.environ.items() if marker not in v})
    try:
        holder.stdin.write(os.path.join(marker, "agent.log") + "\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "open"
        assert marker.encode() not in Path(f"/proc/{holder.pid}/cmdline").read_bytes()
        assert processes_naming(marker) == [holder.pid]
        stop_processes_naming(marker)
        assert holder.wait(timeout=30) != 0 and processes_naming(marker) == []
    finally:
        holder.kill()


def test_the_modules_go_out_longest_first_and_a_module_keeps_its_tests_order():
    import module_seconds

    lines = ["12.50s call     tests/unit/test_b.py::test_one[x]", "0.40s setup    tests/unit/test_b.py::test_two",
             "30.00s call     tests/integration/test_a.py::test_only", "0.00s teardown tests/unit/test_c.py::test_z",
             "(3 durations < 0.005s hidden.)"]
    seconds = module_seconds.parse(lines)
    assert seconds == {"tests/unit/test_b.py": 12.9, "tests/integration/test_a.py": 30.0, "tests/unit/test_c.py": 0.0}

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    collected = [Item(n) for n in ("tests/unit/test_b.py::test_one[x]", "tests/unit/test_b.py::test_two",
                                   "tests/unit/test_c.py::test_z", "tests/unit/test_new.py::test_n",
                                   "tests/integration/test_a.py::test_only")]
    ordered = [i.nodeid for i in module_seconds.order(collected, seconds)]
    assert ordered == ["tests/integration/test_a.py::test_only", "tests/unit/test_b.py::test_one[x]",
                       "tests/unit/test_b.py::test_two", "tests/unit/test_new.py::test_n",  # unlisted: 10 s
                       "tests/unit/test_c.py::test_z"]


def test_the_suite_is_collected_in_the_measured_order(request):
    import module_seconds

    seconds = module_seconds.load()
    assert seconds["tests/integration/test_ray_recovery.py"] > seconds["tests/unit/test_docs.py"]
    collected = list(dict.fromkeys(i.nodeid.split("::")[0] for i in request.session.items))
    assert collected == sorted(collected, key=lambda m: -seconds.get(m, module_seconds.UNLISTED_SECONDS))
    assert "--no-loadscope-reorder" in (REPO / "Makefile").read_text()  # else xdist reorders by test count
