"""Set-up: the torch build matches the machine, and the environment holds only what it needs.

`make venv` installs the CPU build of torch where there is no CUDA device
(scripts/install_torch.sh) and pins it while the package and its extras install; these
tests check the environment they run in (CI runs them in a fresh clone's `.venv`).
"""

from __future__ import annotations

import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent


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
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
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


def test_python_m_zocheck_ray_under_a_python_without_the_dependencies_says_which_python_to_use(tmp_path):
    # outside Ray there is no node's Python to hand over to: the error says what to run instead
    import venv

    venv.create(tmp_path / "bare", with_pip=False)  # a Python with the standard library only
    base = str(tmp_path / "bare" / "bin" / "python")
    lacks = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
    assert subprocess.run([base, "-c", lacks], capture_output=True, timeout=60).returncode == 0
    out = subprocess.run([base, "-m", "zocheck_ray", "status", "x"], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert out.returncode != 0
    assert "ModuleNotFoundError" in out.stderr
    assert f"zocheck-ray's dependencies are not installed for {base}" in out.stderr
    assert "-m zocheck_ray" in out.stderr


def test_every_test_marked_slow_by_name_exists():
    from conftest import SLOW_TESTS

    for module, names in SLOW_TESTS.items():
        source = (ROOT / "tests" / module).read_text()
        for name in [] if names == "*" else sorted(names):
            assert re.search(rf"^def {name}\(", source, re.M), f"conftest.SLOW_TESTS: {module} has no {name}"


def test_the_slow_marker_selects(pytester):
    # in this process: pytest's own collection with the suite's conftest, modules already imported
    files = [str(ROOT / "tests" / name) for name in ("test_tune.py", "test_job_submit.py", "test_setup.py")]

    def collected(expression: str) -> set[str]:
        items, recorder = pytester.inline_genitems("-m", expression, "-p", "no:cacheprovider", "--rootdir",
                                                   str(ROOT), *files)
        deselected = {id(item) for call in recorder.getcalls("pytest_deselected") for item in call.items}
        return {f"{item.path.name}::{item.name}" for item in items if id(item) not in deselected}

    slow, quick = collected("slow"), collected("not slow")
    assert "test_job_submit.py::test_status_of_an_unknown_run_is_a_clear_error" in slow
    assert "test_tune.py::test_restored_trial_resumes_exactly" in slow
    assert "test_tune.py::test_grid_option_parses_values_as_yaml" in quick
    assert "test_setup.py::test_every_test_marked_slow_by_name_exists" in quick
    assert slow and quick and not slow & quick


def test_free_ports_are_distinct():
    # a port released by one lookup is often the kernel's next answer: all of a call's sockets are held at once
    from conftest import free_ports

    for _ in range(20):
        ports = free_ports(9)  # as many as a `ray start --head` takes
        assert len(set(ports)) == 9 and all(0 < p < 65536 for p in ports)
