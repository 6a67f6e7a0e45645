"""`JobConfig`'s groups (`shadow`, `durability`, `failure`, `scaling`): set from YAML and `--set`,
checked across groups, and an older flat job file refused with one line naming the new place."""

from __future__ import annotations

import pytest
import yaml

from zocheck_ray.config import MOVED_FIELDS, JobConfig, JobConfigError, load_job_config

GROUPED = {
    "shadow_cpus": ("shadow.cpus", 2), "shadow_nice": ("shadow.nice", 5),
    "snapshot_interval": ("shadow.snapshot_interval", 4), "max_lag_steps": ("shadow.max_lag_steps", 32),
    "recovery_snapshot": ("shadow.recovery_snapshot", False),
    "durable_interval": ("durability.durable_interval", 8), "storage_share": ("durability.storage_share", 0.5),
    "max_undurable_steps": ("durability.max_undurable_steps", 100),
    "log_seal_records": ("durability.log_seal_records", 16), "lease_seconds": ("durability.lease_seconds", 9.0),
    "max_restarts": ("failure.max_restarts", 3), "standby": ("failure.standby", True),
    "trainers": ("scaling.trainers", 2), "placement": ("scaling.placement", "spread"),
    "use_gpu": ("scaling.use_gpu", "no"),
}
"""Each setting that moved into a group: its new place and a valid value other than the default."""


def value_at(job: JobConfig, dotted: str):
    for key in dotted.split("."):
        job = getattr(job, key)
    return job


def test_every_moved_field_names_a_field_that_exists():
    for old, new in MOVED_FIELDS.items():
        section, _, field = new.partition(".")
        assert field in type(getattr(JobConfig(), section)).model_fields, (old, new)
    assert {old: new for old, new in MOVED_FIELDS.items() if old in GROUPED} == \
        {old: new for old, (new, _) in GROUPED.items()}


@pytest.mark.parametrize("old", sorted(GROUPED))
def test_an_old_flat_field_in_a_job_file_is_refused_with_one_line(tmp_path, old):
    new, value = GROUPED[old]
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"steps": 10, old: value}))
    with pytest.raises(JobConfigError) as error:
        load_job_config(config)
    assert str(error.value) == f"{old} is no longer a job field: set {new} (one place for each setting)"


def test_an_old_flat_field_from_set_is_refused_with_one_line():
    with pytest.raises(JobConfigError) as error:
        load_job_config(overrides=["shadow_cpus=2"])
    assert str(error.value) == "shadow_cpus is no longer a job field: set shadow.cpus (one place for each setting)"
    with pytest.raises(ValueError, match=r"standby is no longer a job field: set failure\.standby \(one place"):
        JobConfig(standby=True)


@pytest.mark.parametrize("old", sorted(GROUPED))
def test_each_grouped_field_is_set_from_a_file_and_from_set(tmp_path, old):
    new, value = GROUPED[old]
    section, _, field = new.partition(".")
    doc = {"steps": 10, section: {field: value}}
    sets = [f"{new}={yaml.safe_dump(value).splitlines()[0]}"]
    if field == "durable_interval":  # a multiple of the snapshot interval
        doc["shadow"] = {"snapshot_interval": 4}
        sets.append("shadow.snapshot_interval=4")
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(doc))
    assert value_at(load_job_config(config), new) == value
    assert value_at(load_job_config(overrides=sets), new) == value


def test_set_adds_to_a_group_the_file_sets(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("shadow:\n  snapshot_interval: 4\nscaling:\n  trainers: 2\n")
    job = load_job_config(config, ["shadow.cpus=2", "task.batch_size=8"])
    assert (job.shadow.snapshot_interval, job.shadow.cpus, job.shadow.nice) == (4, 2, 19)
    assert (job.scaling.trainers, job.scaling.placement, job.task.batch_size) == (2, "pack", 8)


def test_the_groups_keep_their_defaults():
    job = JobConfig()
    assert job.shadow.model_dump() == {"cpus": 1, "nice": 19, "snapshot_interval": None, "max_lag_steps": None,
                                       "recovery_snapshot": True}
    assert job.durability.model_dump() == {"durable_interval": None, "storage_share": 0.1,
                                           "max_undurable_steps": 5000, "log_seal_records": 1024,
                                           "lease_seconds": 30.0}
    assert job.failure.model_dump() == {"max_restarts": 10, "mtbf_hours": None, "standby": False}
    assert job.scaling.model_dump() == {"trainers": 1, "min_trainers": None, "placement": "pack",
                                        "collective_timeout_seconds": 600.0, "use_gpu": "auto"}


def test_a_misspelt_field_inside_a_group_is_refused():
    with pytest.raises(JobConfigError, match=r"shadow\.cpu is not a field of shadow; did you mean shadow\.cpus\?"):
        load_job_config(overrides=["shadow.cpu=2"])


def test_durable_interval_must_be_a_multiple_of_the_shadows_snapshot_interval():
    with pytest.raises(JobConfigError, match=r"durability\.durable_interval=6 is not a multiple of "
                                             r"shadow\.snapshot_interval=4: a durable snapshot is one of the "
                                             r"shadow's snapshots"):
        load_job_config(overrides=["shadow.snapshot_interval=4", "durability.durable_interval=6"])
    job = load_job_config(overrides=["shadow.snapshot_interval=4", "durability.durable_interval=12"])
    assert (job.shadow.snapshot_interval, job.durability.durable_interval) == (4, 12)


def test_the_batch_must_divide_among_the_scaling_trainers():
    with pytest.raises(JobConfigError, match=r"task\.batch_size=16 does not divide among scaling\.trainers=3 "
                                             r"ranks: every rank evaluates an equal slice of the batch; make "
                                             r"task\.batch_size a multiple of scaling\.trainers"):
        load_job_config(overrides=["scaling.trainers=3"])
