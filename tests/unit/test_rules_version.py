"""A run stored under the previous update rules is refused before any work, naming both versions.

Storage "written by the previous rules" is a snapshot whose manifest is rewritten as version-1 code wrote it:
without `rules_version`, its own checksum recomputed. Records carry the rules in their fingerprint.
"""

import hashlib
import json

import pytest
import torch

from zocheck_ray import StepRecord, ZOConfig, replay
from zocheck_ray.config import JobConfig, JobConfigError
from zocheck_ray.control.startup import check_run
from zocheck_ray.core.errors import StateMismatchError
from zocheck_ray.core.layout import Layout
from zocheck_ray.core.record import RULES_VERSION
from zocheck_ray.storage import RulesVersionError, SnapshotStore, audit_run, check_run_rules, recover
from zocheck_ray.storage.manifest import _canonical

CONFIG = ZOConfig(lr=1e-2)


def state():
    return {"w": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(3)}


def write_run(url: str, version: int | None) -> None:
    """A committed snapshot at step 0, its manifest as the code of rules `version` wrote it (None: this code)."""
    info = SnapshotStore(url).save(0, state(), {"run_id": "r", "zo_config": CONFIG.model_dump(mode="json")})
    if version is None:
        return
    path = info.url.removeprefix("file://") + "/manifest.json"
    with open(path) as f:
        body = json.load(f)
    body.pop("manifest_sha256")
    if version == 1:
        body.pop("rules_version")  # version 1 had no such field
    else:
        body["rules_version"] = version
    body["manifest_sha256"] = hashlib.sha256(_canonical(body)).hexdigest()
    with open(path, "w") as f:
        json.dump(body, f)


def test_new_snapshots_carry_this_rules_version(tmp_path):
    write_run(str(tmp_path), None)
    assert SnapshotStore(str(tmp_path), create=False).latest().manifest.rules_version == RULES_VERSION == 2
    assert recover(str(tmp_path)).step == 0


@pytest.mark.parametrize("check", [recover, check_run_rules, audit_run])
def test_storage_of_the_previous_rules_is_refused_with_both_versions(tmp_path, check):
    write_run(str(tmp_path), 1)
    with pytest.raises(RulesVersionError) as info:
        check(str(tmp_path))
    message = str(info.value)
    assert "\n" not in message
    assert "rules version 1" in message and f"applies version {RULES_VERSION}" in message
    assert "start a new run under another storage path" in message


def test_a_job_on_old_storage_fails_its_start_checks_before_ray(tmp_path, monkeypatch):
    job = JobConfig.model_validate({"steps": 2, "storage": str(tmp_path), "run_id": "old-run"})
    write_run(job.run_url, 1)
    monkeypatch.setattr("zocheck_ray.control.startup.connect_ray",
                        lambda **_: pytest.fail("connected to Ray before refusing the storage"))
    with pytest.raises(JobConfigError, match="rules version 1, and this zocheck-ray applies version 2"):
        check_run(job, say=None)


def test_records_carry_the_rules_version_in_their_fingerprint():
    layout = Layout.from_state(state(), CONFIG)
    fingerprints = {v: layout.fingerprint(CONFIG, rules=v) for v in (1, 2, 3)}
    assert fingerprints[RULES_VERSION] == layout.fingerprint(CONFIG) and len(set(fingerprints.values())) == 3
    with pytest.raises(StateMismatchError, match="fingerprint"):  # a later version's record: not one we know
        replay(state(), [StepRecord(0, 7, 0.5, 1e-2, 1e-3, fingerprints[3])], CONFIG, start_step=0)


LLAMA_LIKE = {"model.layers.0.fc.weight": torch.zeros(2, 3), "model.layers.0.fc.bias": torch.zeros(3),
              "model.norm.weight": torch.zeros(3)}
PREVIOUS_FINGERPRINTS = {"zo-sgd": 0xd89baef92099e5c2, "zo-sgd-sign": 0xcf263f05ab864f98}
"""What the previous release (rules version 1) put in the records of LLAMA_LIKE with weight_decay=0.1."""


@pytest.mark.parametrize("optimizer", sorted(PREVIOUS_FINGERPRINTS))
def test_records_of_the_previous_rules_are_refused_naming_both_versions(optimizer):
    config = ZOConfig(optimizer=optimizer, lr=1e-2, weight_decay=0.1)
    state = {k: v.clone() for k, v in LLAMA_LIKE.items()}
    assert Layout.from_state(state, config).fingerprint(config, rules=1) == PREVIOUS_FINGERPRINTS[optimizer]
    old = StepRecord(0, 7, 0.5, 1e-2, 1e-3, PREVIOUS_FINGERPRINTS[optimizer], optimizer)
    with pytest.raises(StateMismatchError, match="update rules version 1, and this zocheck-ray applies version 2"):
        replay(state, [old], config, start_step=0)
    assert torch.equal(state["model.norm.weight"], LLAMA_LIKE["model.norm.weight"])  # refused before any work
