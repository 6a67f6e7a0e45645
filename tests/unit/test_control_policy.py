"""The failure policy is one pure table: every kind of failure has its row, a lost trainer spends
the run's failure budget, and a decision's reason says what to do."""

import typing

import pytest

from zocheck_ray.config import JobConfig
from zocheck_ray.control import Action, Failure, FailureBudget, decide
from zocheck_ray.control.policy import FailureKind, LagBound

EXPECTED = {
    "trainer_lost": Action.RESTART, "shadow_lag": Action.RESYNC, "replay_error": Action.RESYNC,
    "records_lost": Action.RESTART, "trainer_gone": Action.FAIL, "shadow_gone": Action.FAIL,
    "durability_stalled": Action.FAIL, "writer_lost": Action.FAIL, "drain_failed": Action.FAIL,
    "storage_lost": Action.FAIL, "storage_refused": Action.FAIL, "input_refused": Action.FAIL,
}


@pytest.fixture
def job(tmp_path):
    return JobConfig(storage=str(tmp_path), failure={"max_restarts": 2})


def test_every_kind_of_failure_has_its_row(job):
    assert set(EXPECTED) == set(typing.get_args(FailureKind))
    for kind, action in EXPECTED.items():
        decision = decide(Failure(kind, 7, f"the {kind} detail", ranks=(0,)), job,
                          FailureBudget(job.failure.max_restarts))
        assert decision.action is action, kind
        assert decision.reason, kind


def test_lost_trainers_spend_the_budget_and_the_one_too_many_fails_the_run_naming_max_restarts(job):
    budget = FailureBudget(job.failure.max_restarts)
    lost = Failure("trainer_lost", 3, "the process exited", mode="software", ranks=(1,))
    assert [decide(lost, job, budget).action for _ in range(2)] == [Action.RESTART, Action.RESTART]
    assert "rank 1" in decide(Failure("trainer_lost", 4, "", ranks=(1,)), job, FailureBudget(5)).reason
    final = decide(lost, job, budget)
    assert final.action is Action.FAIL and "failure.max_restarts=2" in final.reason and budget.spent == 3


def test_a_failed_storage_decision_names_the_storage_and_how_to_resume(job):
    reason = decide(Failure("durability_stalled", 9, "no durable step for 40 steps"), job,
                    FailureBudget(job.failure.max_restarts)).reason
    assert job.run_url in reason and "no durable step for 40 steps" in reason
    assert decide(Failure("shadow_lag", 9, ""), job, FailureBudget(0)).action is Action.RESYNC  # spends nothing


def test_a_lag_resync_names_the_bound_in_force_and_who_set_it(job):
    assert decide(Failure("shadow_lag", 9, "lag 70 steps"), job, FailureBudget(0)).reason == \
        "the shadow lags more than 64 steps (the default: set shadow.max_lag_steps, or failure.mtbf_hours for the " \
        "cost model's)"
    bound = LagBound(12, "the cost model's bound from the startup profile")
    assert decide(Failure("shadow_lag", 9, ""), job, FailureBudget(0), bound).reason == \
        "the shadow lags more than 12 steps (the cost model's bound from the startup profile)"


def test_records_no_process_holds_are_a_host_failure_in_two_steps_every_rank_restores_from_the_durable_state(job):
    lost = Failure("records_lost", 36, "the shadow holds the records up to step 24, the trainers are at step 36")
    decision = decide(lost, job, FailureBudget(0))  # no process of this run is lost now: nothing is spent
    assert decision.action is Action.RESTART
    assert "the shadow holds the records up to step 24" in decision.reason
    assert "one after the other" in decision.reason and "durable image" in decision.reason
