"""deploy/: the runtime env, the example job configs, the KubeRay RayJob, the Ray cluster YAML
and the image agree with each other and with the code (no cluster needed)."""

from __future__ import annotations

import os
import re
import shlex
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from support import REPO
from zocheck_ray.config import RAY_JOB_ENV, JobConfig, check_job_environment, load_job_config

DEPLOY = REPO / "deploy"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
"""The user's documentation: the README and its reference chapters."""
EXAMPLES = sorted((DEPLOY / "examples").glob("*.yaml"))
CREDENTIAL_NAME = re.compile(r"SECRET|PASSWORD|TOKEN|ACCESS_KEY|KEY_ID|CREDENTIAL", re.I)
AWS_KEY_ID = re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")
CREDENTIAL_OPTIONS = {"key", "secret", "token", "aws_access_key_id", "aws_secret_access_key", "aws_session_token",
                      "password"}


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def pinned_ray_version() -> str:
    """The newest Ray of the supported range (`make test` runs it; the deploy files' images carry it)."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["zocheck-ray"]["ray-newest"]


def image_workdir() -> str:
    (line,) = [l for l in (DEPLOY / "Dockerfile").read_text().splitlines() if l.startswith("WORKDIR ")]
    return line.split()[1].rstrip("/")


def quantity(text) -> float:
    """A Kubernetes quantity ("12", "500m", "96Gi", "24000000000") as a number."""
    match = re.fullmatch(r"([0-9.]+)(m|Ki|Mi|Gi|Ti|k|M|G|T)?", str(text))
    assert match, f"not a Kubernetes quantity: {text!r}"
    scale = {None: 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9,
             "T": 1e12}
    return float(match.group(1)) * scale[match.group(2)]


ENTRYPOINT = ["python3", "-m", "zocheck_ray"]
"""How the deploy files start the command line: the `python3` of the environment the cluster runs Ray from
(one without the dependencies says in one line what to do)."""


def command_args(argv: list[str]) -> list[str]:
    """The `zocheck-ray` arguments of an entrypoint (`python3 -m zocheck_ray ...`)."""
    assert argv[:3] == ENTRYPOINT, f"an entrypoint starts with {' '.join(ENTRYPOINT)}: {argv}"
    return argv[3:]


def entrypoint_job(argv: list[str], model_root: str | None = None) -> tuple[JobConfig, dict[str, str]]:
    """The job a `python3 -m zocheck_ray train --config F --set k=v ...` command line runs.

    The config path is inside the image (Dockerfile WORKDIR) and maps onto this repository.
    A `model=` override naming a directory under `model_root` (a volume of the cluster) is
    returned apart, since that directory exists only there.
    """
    args = command_args(argv)
    assert args[:1] == ["train"], argv
    config, sets = None, {}
    args = iter(args[1:])
    for arg in args:
        if arg == "--config":
            config = next(args)
        elif arg == "--set":
            key, value = next(args).split("=", 1)
            sets[key] = value
        elif arg == "--storage":
            sets["storage"] = os.path.expandvars(next(args))  # "$PWD/runs", as the shell expands it
        else:
            pytest.fail(f"unexpected argument {arg!r} in {argv}")
    assert config is not None, "the entrypoint names a --config"
    if config.startswith("/"):
        assert config.startswith(image_workdir() + "/"), f"{config} lies outside the image's repository copy"
        config = config[len(image_workdir()) + 1:]
    path = REPO / config
    assert path.is_file(), f"the entrypoint's config {config} is not in the repository"
    model = sets.pop("model", None)
    if model is not None and model_root is not None:
        assert model.startswith(model_root + "/"), f"model {model} is not on the models volume {model_root}"
    elif model is not None:
        sets["model"] = model
    job = load_job_config(path, [f"{k}={v}" for k, v in sets.items()])
    return job, ({"model": model} if model else {})


def submit_commands(text: str) -> list[list[str]]:
    """The entrypoints (after `--`) of the `ray job submit` commands in a file's text,
    continuation lines (ending in a backslash) joined, comment marks dropped."""
    lines = [l.strip().lstrip("#").strip() for l in text.splitlines()]
    commands, i = [], 0
    while i < len(lines):
        if re.search(r"ray job submit (-|\\$)", lines[i]):  # a command, not prose about one
            command = lines[i]
            while command.endswith("\\"):
                i += 1
                command = command[:-1] + " " + lines[i]
            argv = shlex.split(command[command.index("ray job submit"):])
            assert "--working-dir" in argv and "--runtime-env" in argv and "--" in argv, command
            assert argv[argv.index("--runtime-env") + 1] == "deploy/runtime_env.yaml", command
            commands.append(argv[argv.index("--") + 1:])
        i += 1
    return commands


def assert_no_credentials_in_options(job: JobConfig, where: str) -> None:
    leaked = CREDENTIAL_OPTIONS & {k.lower() for k in job.storage_options}
    assert not leaked, f"{where}: storage_options hold credentials {leaked}; take them from the environment"


# ---------------------------------------------------------------------------- example configs

def test_the_named_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"sst2-opt.yaml", "sst2-opt-gpu-s3.yaml", "lm-llama.yaml"} <= names


NEEDS_LOCAL_FILES = {"sst2-opt-mezo.yaml", "sst2-opt-mezo-lora.yaml", "sst2-opt-mezo-prefix.yaml"}
"""Examples of a model and data set saved locally first: their schema here, their run in test_mezo_examples.py."""


def validate_example(path: Path) -> JobConfig:
    return JobConfig.model_validate(load_yaml(path)) if path.name in NEEDS_LOCAL_FILES else load_job_config(path)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_config_validates(path):
    job = validate_example(path)
    assert_no_credentials_in_options(job, path.name)
    assert "run_id" not in load_yaml(path), "examples leave run_id to each run (or to --set)"


def test_every_config_the_docs_mention_exists_and_validates():
    texts = {p: p.read_text() for p in [*DOCS, *DEPLOY.rglob("*")] if p.is_file()}
    mentioned = {m for text in texts.values() for m in re.findall(r"deploy/examples/[\w.-]+\.yaml", text)}
    assert "deploy/examples/sst2-opt.yaml" in mentioned
    for rel in mentioned:
        assert (REPO / rel).is_file(), f"{rel} is mentioned but does not exist"
        validate_example(REPO / rel)


def test_every_documented_submit_command_runs_a_valid_job():
    found = 0
    for path in [*DOCS, *DEPLOY.rglob("*.yaml")]:
        for argv in submit_commands(path.read_text()):
            if command_args(argv)[:1] == ["train"]:
                job, _ = entrypoint_job(argv, model_root="/models")
                check_job_environment(job, {RAY_JOB_ENV: "{}"})  # a submitted job: no relative storage
                found += 1
    assert found >= 3


# ---------------------------------------------------------------------------- runtime env

def runtime_env() -> dict:
    return load_yaml(DEPLOY / "runtime_env.yaml")


def test_runtime_env_installs_nothing_and_sets_string_env_vars():
    env = runtime_env()
    assert set(env) <= {"excludes", "env_vars"}, "the image or environment brings the packages"
    assert "working_dir" not in env  # given by `ray job submit --working-dir .`
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env["env_vars"].items())


def test_runtime_env_excludes_keep_the_upload_to_the_sources(tmp_path):
    from ray._private.runtime_env.packaging import create_package

    tree = {
        ".git/objects/pack/big.pack": 2 << 20, ".venv/lib/site.py": 10, "runs/run-1/snapshots/model.safetensors": 10,
        "zocheck_ray/__pycache__/tune.cpython-311.pyc": 10, "zocheck_ray/core/fused._kernel-1.py311.nbi": 10,
        "zocheck_ray/core/fused._kernel-1.py311.1.nbc": 10, "benchmarks/results/replay.json": 10,
        "zocheck_ray.egg-info/PKG-INFO": 10, ".pytest_cache/v/x": 10,
        "zocheck_ray/__init__.py": 10, "zocheck_ray/workload/data/sst2_small.jsonl": 10,
        "deploy/examples/sst2-opt.yaml": 10, "pyproject.toml": 10,
    }
    for rel, size in tree.items():
        (tmp_path / "repo" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "repo" / rel).write_bytes(b"x" * size)
    target = tmp_path / "pkg.zip"
    # without .gitignore: the runtime env's excludes alone must keep the upload small
    create_package(str(tmp_path / "repo"), target, include_gitignore=False, excludes=runtime_env()["excludes"])
    names = {n for n in zipfile.ZipFile(target).namelist() if not n.endswith("/")}
    assert names == {"zocheck_ray/__init__.py", "zocheck_ray/workload/data/sst2_small.jsonl",
                     "deploy/examples/sst2-opt.yaml", "pyproject.toml"}


def test_the_repository_upload_is_small_and_complete(tmp_path):
    from ray._private.runtime_env.packaging import create_package

    target = tmp_path / "pkg.zip"
    create_package(str(REPO), target, include_gitignore=True, excludes=runtime_env()["excludes"])
    names = set(zipfile.ZipFile(target).namelist())
    assert {"zocheck_ray/cli.py", "zocheck_ray/workload/data/sst2_small.jsonl", "deploy/examples/sst2-opt.yaml",
            "deploy/runtime_env.yaml"} <= names
    assert not any(n.startswith((".git/", ".venv/", "runs/", "tests/")) for n in names)
    assert target.stat().st_size < 2 << 20, f"working-dir upload is {target.stat().st_size} bytes"


# ---------------------------------------------------------------------------- KubeRay RayJob

@pytest.fixture(scope="module")
def rayjob() -> dict:
    return load_yaml(DEPLOY / "kuberay" / "rayjob.yaml")


def containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def test_rayjob_is_a_kuberay_v1_job_on_the_pinned_ray(rayjob):
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    spec = rayjob["spec"]
    assert spec["rayClusterSpec"]["rayVersion"] == pinned_ray_version()
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    for params in [cluster["headGroupSpec"]["rayStartParams"], *(g["rayStartParams"] for g in cluster["workerGroupSpecs"])]:
        assert all(isinstance(v, str) for v in params.values()), f"rayStartParams is a map of strings: {params}"
    runtime = yaml.safe_load(spec["runtimeEnvYAML"])
    assert not {"pip", "conda", "uv"} & set(runtime)
    assert runtime["env_vars"] == runtime_env()["env_vars"]


def gpu_group(rayjob) -> dict:
    groups = [g for g in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
              if any("nvidia.com/gpu" in c["resources"]["limits"] for c in containers(g["template"]))]
    assert len(groups) == 1, "one GPU worker group"
    return groups[0]


def models_mount(pod_template: dict) -> str:
    claims = {v["name"] for v in pod_template["spec"]["volumes"] if "persistentVolumeClaim" in v}
    (mount,) = [m["mountPath"] for c in containers(pod_template) for m in c.get("volumeMounts", [])
                if m["name"] in claims]
    return mount


def test_rayjob_entrypoint_runs_an_example_config_that_validates(rayjob):
    spec = rayjob["spec"]
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]
    worker = gpu_group(rayjob)["template"]
    # the driver checks the model directory on the head, the trainer loads it on the worker
    assert models_mount(head) == models_mount(worker)
    job, apart = entrypoint_job(shlex.split(spec["entrypoint"]), model_root=models_mount(head))
    assert apart["model"].startswith("/models/")
    assert job.scaling.use_gpu == "yes"
    assert job.storage.startswith("s3://")
    assert_no_credentials_in_options(job, "RayJob entrypoint")


def test_gpu_worker_group_fits_trainer_and_shadow_on_one_node(rayjob):
    spec = rayjob["spec"]
    job, _ = entrypoint_job(shlex.split(spec["entrypoint"]), model_root="/models")
    head = spec["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "the head runs the driver only, so the pair lands on the GPU node"
    group = gpu_group(rayjob)
    params = group["rayStartParams"]
    (container,) = containers(group["template"])
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert limits == requests, "guaranteed resources: what Ray is told is what the pod has"
    ray_cpus, ray_gpus = int(params["num-cpus"]), int(params["num-gpus"])
    assert ray_gpus >= 1 and quantity(limits["nvidia.com/gpu"]) >= ray_gpus
    assert ray_cpus >= 1 + job.shadow.cpus, "trainer (1 CPU) + shadow (shadow.cpus) in one STRICT_PACK group"
    assert quantity(limits["cpu"]) >= ray_cpus
    store = quantity(params["object-store-memory"])
    assert store + 32 * 2**30 <= quantity(limits["memory"]), "room for the replica and the processes beside the store"
    (shm,) = [v for v in group["template"]["spec"]["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert any(m["name"] == shm["name"] and m["mountPath"] == "/dev/shm" for m in container["volumeMounts"])
    assert quantity(shm["emptyDir"]["sizeLimit"]) >= store, "the object store lives in /dev/shm"
    assert group["minReplicas"] >= 1 and group["replicas"] >= 1


def test_rayjob_reaches_s3_without_embedded_credentials(rayjob):
    text = (DEPLOY / "kuberay" / "rayjob.yaml").read_text()
    assert not AWS_KEY_ID.search(text)
    cluster = rayjob["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"], gpu_group(rayjob)["template"]]
    for pod in pods:  # the driver checks the storage, the shadow writes it: both reach S3
        assert pod["spec"]["serviceAccountName"] == "zocheck"
        for container in containers(pod):
            env = {e["name"]: e for e in container["env"]}
            assert "AWS_REGION" in env
            for name, entry in env.items():
                if CREDENTIAL_NAME.search(name):
                    assert "value" not in entry, f"{name} is embedded; take it from a Secret"
                    assert "secretKeyRef" in entry["valueFrom"]
    images = {c["image"] for pod in pods for c in containers(pod)}
    assert len(images) == 1, "every node runs the same image"


# ---------------------------------------------------------------------------- Ray cluster YAML

@pytest.fixture(scope="module")
def cluster() -> dict:
    return load_yaml(DEPLOY / "cluster.yaml")


def test_cluster_yaml_places_trainer_and_shadow_on_a_gpu_worker(cluster):
    gpu_job = load_job_config(DEPLOY / "examples" / "sst2-opt-gpu-s3.yaml")
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types
    assert types[cluster["head_node_type"]]["resources"] == {"CPU": 0}
    gpu_types = [t for t in types.values() if t["resources"].get("GPU", 0) >= 1]
    assert gpu_types, "a GPU worker type"
    for node_type in gpu_types:
        assert node_type["resources"]["CPU"] >= 1 + gpu_job.shadow.cpus
        assert node_type["min_workers"] >= 1
    head_port = re.search(r"--port=(\d+)", " ".join(cluster["head_start_ray_commands"])).group(1)
    assert f"$RAY_HEAD_IP:{head_port}" in " ".join(cluster["worker_start_ray_commands"])
    store = int(re.search(r"--object-store-memory=(\d+)", " ".join(cluster["worker_start_ray_commands"])).group(1))
    shm = re.search(r"--shm-size=(\d+)g", " ".join(cluster["docker"]["run_options"])).group(1)
    assert int(shm) * 2**30 >= store


def test_cluster_yaml_uses_an_instance_role_and_the_project_image(cluster, rayjob):
    text = (DEPLOY / "cluster.yaml").read_text()
    assert not AWS_KEY_ID.search(text) and "aws_secret_access_key" not in text.lower()
    for node_type in cluster["available_node_types"].values():
        assert node_type["node_config"]["IamInstanceProfile"]["Name"]
    (rayjob_image,) = {c["image"] for c in containers(gpu_group(rayjob)["template"])}
    assert cluster["docker"]["image"] == rayjob_image
    # the submit command in its header runs an example that validates (model from /models)
    (argv,) = submit_commands(text)
    job, apart = entrypoint_job(argv, model_root="/models")
    assert apart["model"].startswith("/models/") and "-v /models:/models" in cluster["docker"]["run_options"]


# ---------------------------------------------------------------------------- image

def test_image_builds_on_the_pinned_ray_and_torch():
    text = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"^FROM rayproject/ray:([0-9.]+)-py3\d+-gpu$", text, re.M)
    assert base and base.group(1) == pinned_ray_version()
    torch_pin = re.search(r"^version=([0-9.]+)$", (REPO / "scripts" / "install_torch.sh").read_text(), re.M).group(1)
    assert f'"torch=={torch_pin}"' in text
    for path in ("zocheck_ray", "deploy", "pyproject.toml"):
        assert re.search(rf"^COPY .*\b{re.escape(path)}\b", text, re.M), f"the image lacks {path}"
