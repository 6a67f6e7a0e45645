"""The parts of `zocheck-ray status` that need no cluster: which placement group is a run's first, and the
hyperparameter changes of the run's identity as the shadow reads them (tests/integration/test_status.py runs the
command on a cluster)."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

from zocheck_ray.config import JobConfig
from zocheck_ray.control.identity import check_identity
from zocheck_ray.control.placement import group_name
from zocheck_ray.control.startup import build_task_once
from zocheck_ray.train_cli import describe_changes, identity_changes, own_group


def test_a_runs_first_placement_group_is_told_from_its_others_and_other_runs():
    tag = uuid.uuid4().hex[:8]
    assert own_group("r1").fullmatch(f"{group_name('r1')}-{tag}")  # the name Placement gives it
    for other in (f"{group_name('r1')}-{tag}-ranks", f"{group_name('r1')}-{tag}-rank1", f"{group_name('r1-b')}-{tag}"):
        assert not own_group("r1").fullmatch(other), other


def test_the_shadow_reads_the_changes_its_runs_identity_recorded(tmp_path):
    job = JobConfig(run_id="r1", storage=str(tmp_path), zo={"lr": 5e-3})
    shadow = SimpleNamespace(job=job)  # what `identity_changes` reads of the shadow's actor
    task = build_task_once(job)
    check_identity(job, task, None, print).record()
    assert identity_changes(shadow) == []
    resumed = job.model_copy(update={"zo": job.zo.model_copy(update={"lr": 1e-3})})
    check_identity(resumed, task, 40, print).record()
    assert identity_changes(shadow) == [{"step": 40, "field": "zo.lr", "old": 5e-3, "new": 1e-3}]


def test_changes_are_one_line():
    assert describe_changes([]) == "none"
    assert describe_changes([{"step": 40, "field": "zo.lr", "old": 5e-3, "new": 1e-3},
                             {"step": 90, "field": "zo.eps", "old": 1e-3, "new": 1e-2}]) == \
        "zo.lr 0.005 -> 0.001 from step 40; zo.eps 0.001 -> 0.01 from step 90"
    assert describe_changes("unknown: the store did not answer") == "unknown: the store did not answer"
