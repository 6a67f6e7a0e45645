"""MeZO's sampler as its run.py draws rows, and deploy/examples/sst2-opt-mezo.yaml run to its first evaluation.

MeZO's `sample_subset` seeds numpy's global generator (`np.random.seed`) and takes a permutation's first rows;
the dev rows end the training draw (run.py: `train_samples[-num_dev:]`), the evaluation rows are a permutation of
the validation split under the same seed.
"""

import json

import datasets
import numpy as np
import pytest

from support import REPO
from zocheck_ray.control.startup import build_task_once
from zocheck_ray.config import JobConfigError, load_job_config
from zocheck_ray.testing.in_process import run_in_process
from zocheck_ray.workload import TaskConfig, build_task
from zocheck_ray.workload.sampling import mezo_sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXAMPLE = REPO / "deploy" / "examples" / "sst2-opt-mezo.yaml"


def mezo_sample_subset(rows, seed, num):
    """MeZO's tasks.py `sample_subset`, as its code does it (numpy's global generator)."""
    state = np.random.get_state()
    np.random.seed(seed)
    index = np.random.permutation(len(rows)).tolist()[:num]
    np.random.set_state(state)
    return [rows[i] for i in index]


def sst2_folder(tmp_path, n_train=40, n_valid=12) -> str:
    row = lambda i: {"sentence": f"film number {i} was {'good' if i % 2 else 'bad'} ", "label": i % 2, "idx": i}
    path = tmp_path / "sst2"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([row(i) for i in range(n_train)]),
                          "validation": datasets.Dataset.from_list([row(100 + i) for i in range(n_valid)])}
                         ).save_to_disk(str(path))
    return str(path)


def test_mezo_sample_is_mezo_s_permutation_with_dev_rows_at_the_end():
    train, held = list(range(50)), list(range(100, 120))
    picked = mezo_sample_subset(train, 3, 10 + 4)
    assert mezo_sample(train, held, 10, 4, 5, seed=3) == (picked[:-4], picked[-4:], mezo_sample_subset(held, 3, 5))
    assert mezo_sample(train, held, 60, None, None, seed=3) == (mezo_sample_subset(train, 3, 60), [], held)


def test_a_task_samples_train_dev_and_eval_rows_as_mezo_and_reports_dev_metrics(tmp_path):
    from zocheck_ray.workload import build_model

    task = build_task(TaskConfig(data_path=sst2_folder(tmp_path), num_train=8, num_dev=4, num_eval=6,
                                 train_set_seed=2, batch_size=4, eval_batch_size=4), "tiny-opt")
    assert (task.n_train, len(task.dev_examples), task.n_eval) == (8, 4, 6)
    train_rows = datasets.load_from_disk(str(tmp_path / "sst2"))["train"].to_list()
    picked = mezo_sample_subset(train_rows, 2, 12)
    train, dev = _jsonl(tmp_path, picked[:8]), _jsonl(tmp_path, picked[8:], "dev")
    expected = build_task(TaskConfig(data_path=str(train), eval_path=str(dev), batch_size=4, eval_size=4), "tiny-opt")
    assert task.train_examples == expected.train_examples and task.dev_examples == expected.eval_examples
    metrics = task.evaluate(build_model("tiny-opt"))
    assert set(metrics) == {"accuracy", "loss", "dev_accuracy", "dev_loss"}
    assert task.summary()["dev_rows"] == 4


def _jsonl(tmp_path, rows, name="train"):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_sampler_s_mistakes_get_one_line(tmp_path):
    with pytest.raises(ValueError, match="set task.num_train too"):
        TaskConfig(num_dev=3)
    with pytest.raises(ValueError, match="two samplers"):
        TaskConfig(num_train=3, k_shot=2)
    with pytest.raises(JobConfigError, match="draws held-out rows from a validation split") as info:
        build_task_once(load_job_config(overrides=[f"storage={tmp_path}", "task.num_train=8"]))
    assert "\n" not in str(info.value)


@pytest.mark.slow  # a run, in process
@pytest.mark.parametrize("name, lr, eps, peft", [
    ("sst2-opt-mezo", 1e-7, 1e-3, None),
    ("sst2-opt-mezo-lora", 5e-5, 1e-2, {"method": "lora", "r": 8, "lora_alpha": 16.0,
                                        "target_modules": ["q_proj", "v_proj"]}),
    ("sst2-opt-mezo-prefix", 1e-3, 1e-1, {"method": "prefix", "num_virtual_tokens": 5})])
def test_each_mezo_sst2_example_runs_to_its_first_evaluation(tmp_path, name, lr, eps, peft):
    """MeZO's three settings (mezo.sh MODE=ft, lora, prefix) with a tiny OPT and rows written here in place of
    OPT-13B and GLUE's SST-2."""
    job = load_job_config(EXAMPLE.with_name(f"{name}.yaml"), overrides=[
        "model=tiny-opt", "dtype=fp32", f"storage={tmp_path / 'runs'}", f"task.data_path={sst2_folder(tmp_path)}",
        "task.max_length=48", "task.num_train=16", "task.num_dev=4", "task.num_eval=4", "steps=1",
        "log_interval=1"])
    assert (job.zo.lr, job.zo.eps, job.task.batch_size, job.task.eval_interval) == (lr, eps, 16, 4000)
    assert (job.task.num_train, job.task.train_set_seed) == (16, 0)
    if peft is None:
        assert job.peft is None
    else:
        assert job.peft.model_dump(include=set(peft)) == peft
    run = run_in_process(job)
    assert sorted(run.evaluations) == [0, 1]
    assert {"accuracy", "dev_accuracy"} <= set(run.evaluations[0])


def test_the_best_dev_step_is_mezo_s_best_checkpoint():
    """HF's `load_best_model_at_end` with no `metric_for_best_model`: the lowest eval (dev) loss, the first on ties,
    among the evaluations after training began."""
    from zocheck_ray.control.summary import best_dev_step

    ev = {0: {"dev_loss": 0.1, "accuracy": 0.5}, 4: {"dev_loss": 0.6}, 8: {"dev_loss": 0.4}, 12: {"dev_loss": 0.4}}
    assert best_dev_step(ev) == 8
    assert best_dev_step({0: {"accuracy": 0.5}, 4: {"accuracy": 0.6}}) is None


@pytest.mark.slow  # a run, in process
def test_the_best_dev_snapshot_survives_a_host_failure_and_is_the_state_of_that_step(tmp_path):
    """Dev rows evaluated every 2 steps, snapshots every 4, a host failure at step 5: the pinned snapshot is the
    trainer's state at the best dev step (step 4 here, which retention, keeping the newest two, would delete), the
    other evaluation steps' snapshots are released, and the run's states are those of the uninterrupted run."""
    from zocheck_ray.control.summary import best_dev_step
    from zocheck_ray.storage import SnapshotStore
    from zocheck_ray.testing.reference import uninterrupted_hashes

    job = load_job_config(EXAMPLE, overrides=[
        "model=tiny-opt", "dtype=fp32", f"storage={tmp_path / 'runs'}", f"task.data_path={sst2_folder(tmp_path)}",
        "task.max_length=32", "task.batch_size=4", "task.num_train=16", "task.num_dev=4", "task.num_eval=4",
        "task.eval_interval=2", "zo.lr=1e-2", "steps=8", "log_interval=2", "shadow.snapshot_interval=4",
        "hash_every_step=true"])
    run = run_in_process(job, host=[5])
    best = best_dev_step(run.evaluations)
    assert run.metrics.best_dev_step == best and best is not None
    store = SnapshotStore(job.run_url, create=False)
    pinned = store.get(best)
    assert run.metrics.best_dev_snapshot == pinned.url and store.retention().pins == {"best_dev": best}
    assert {i.step for i in store.committed()} == {8, 6, best}
    assert pinned.state_hash == run.step_hashes[best][0]
    expected = uninterrupted_hashes(job)
    assert {step: hashes[-1] for step, hashes in run.step_hashes.items()} == \
        {step: expected[step] for step in run.step_hashes}
