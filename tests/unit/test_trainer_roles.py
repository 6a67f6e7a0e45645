"""A trainer's role moves WAITING -> RESTORING -> RANK -> TORN -> RESTORING -> RANK, and nothing else.

In process (the same `Trainer` and `Shadow` a Ray run puts in two processes): a waiting trainer and a
torn rank refuse to train or hash with `RejoinRequiredError` naming their role; a rejoin restores them
through RESTORING to the state the shadow holds; a failed restore leaves a waiting trainer waiting.
"""

import json

import pytest

from zocheck_ray.config import JobConfig
from zocheck_ray.runtime.hooks import NoHooks
from zocheck_ray.runtime.messages import Role
from zocheck_ray.runtime.shadow import Shadow
from zocheck_ray.runtime.trainer import RejoinRequiredError, RoleError, Trainer
from zocheck_ray.testing.in_process import InProcessLink

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: see conftest


@pytest.fixture
def job(tmp_path):
    corpus = tmp_path / "rows.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"row {i} of a small corpus"}) for i in range(8)) + "\n")
    return JobConfig.model_validate(dict(
        steps=6, storage=str(tmp_path / "run"), shadow=dict(snapshot_interval=2, max_lag_steps=1000),
        durability=dict(durable_interval=4), log_interval=2, zo=dict(lr=5e-3, eps=1e-2),
        task=dict(kind="lm", data_path=str(corpus), text_field="text", batch_size=2, max_length=16, eval_size=1,
                  eval_interval=1000)))


class SeesRoles(NoHooks):
    """Records the trainer's role once a restored image is in place, before its records are replayed."""

    def __init__(self):
        self.trainer, self.seen = None, []

    def after_restore(self) -> None:
        self.seen.append(self.trainer.role)


def test_a_new_rank_restores_and_trains(job):
    shadow = Shadow(job)
    trainer = Trainer(job, InProcessLink(shadow))
    try:
        assert trainer.role is Role.RANK and trainer.recovery.role is Role.RANK
        assert trainer.recovery.source == "fresh"
        assert trainer.run(2).step == 2 and trainer.state_hash()[0] == 2
    finally:
        trainer.close()
        shadow.close()


def test_a_waiting_trainer_trains_only_after_it_rejoins(job):
    shadow = Shadow(job)
    first, hooks = Trainer(job, InProcessLink(shadow)), SeesRoles()
    waiting = Trainer(job, InProcessLink(shadow), hooks=hooks, waits=True)
    hooks.trainer = waiting
    try:
        first.run(3)
        assert waiting.role is Role.WAITING and waiting.recovery.role is Role.WAITING
        assert waiting.recovery.source == "deferred" and waiting.recovery.step is None
        with pytest.raises(RejoinRequiredError, match="rank 0 is waiting"):
            waiting.run(4)
        with pytest.raises(RejoinRequiredError, match="rank 0 is waiting"):
            waiting.state_hash()
        info = waiting.rejoin(3)
        assert hooks.seen == [Role.RESTORING]
        assert waiting.role is Role.RANK and info.role is Role.RANK and info.step == 3
        assert waiting.state_hash() == first.state_hash()
    finally:
        first.close()
        waiting.close()
        shadow.close()


def test_a_failed_gather_tears_a_rank_until_it_rejoins(job):
    # Rank 0 of two, in no process group: its first gather fails mid-perturbation.
    job = job.model_copy(update={"scaling": job.scaling.model_copy(update={"trainers": 2})})
    shadow = Shadow(job)
    hooks = SeesRoles()
    rank = Trainer(job, InProcessLink(shadow), hooks=hooks)
    hooks.trainer = rank
    try:
        initial = rank.state_hash()
        progress = rank.run(2)
        assert rank.role is Role.TORN and progress.interrupted == 0 and progress.step == 0
        assert rank.progress().interrupted == 0  # until it rejoins
        with pytest.raises(RejoinRequiredError, match="rank 0 is torn at step 0"):
            rank.run(2)
        with pytest.raises(RejoinRequiredError, match="rank 0 is torn at step 0"):
            rank.state_hash()
        info = rank.rejoin(0)
        assert hooks.seen == [Role.RESTORING] and info.role is Role.RANK and info.source == "memory"
        assert rank.role is Role.RANK and rank.state_hash() == initial
        assert rank.progress().interrupted is None
    finally:
        rank.close()
        shadow.close()


def test_a_failed_restore_leaves_a_waiting_trainer_waiting(job):
    shadow = Shadow(job)  # never initialized: it holds no image
    waiting = Trainer(job, InProcessLink(shadow), waits=True)
    try:
        with pytest.raises(RuntimeError, match="holds no image"):
            waiting.rejoin(None)
        assert waiting.role is Role.WAITING
    finally:
        waiting.close()
        shadow.close()


def test_a_move_the_transitions_forbid_raises_naming_both_roles(job):
    shadow = Shadow(job)
    waiting = Trainer(job, InProcessLink(shadow), waits=True)
    try:
        with pytest.raises(RoleError, match="from waiting to rank"):
            waiting._become(Role.RANK)
        with pytest.raises(RoleError, match="from waiting to torn"):
            waiting._become(Role.TORN)
        assert waiting.role is Role.WAITING
    finally:
        waiting.close()
        shadow.close()
