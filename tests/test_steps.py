"""What a learner step leaves behind (sched/steps.py), value by value: its metrics record, its batch
record and its warnings, from a step's `StepResult` as `RLLearner.train_step` returns it."""

from __future__ import annotations

from dataclasses import replace

from asyncrl.records import StepResult, Trajectory
from asyncrl.sched.groups import Group
from asyncrl.sched.steps import batch_record, consistency_warnings, step_record


def result() -> StepResult:
    return StepResult(
        version=7, stepped=True, loss=0.25, grad_norm=1.5, padded=3,
        ledger={"trained": 3, "aborted": 1}, staleness={0: 30, 2: 10},
    )  # fmt: skip


def groups() -> list[Group]:
    first = [Trajectory("a", group_id="g1", status="ok", reward=1.0), Trajectory("b", group_id="g1", status="ok", reward=0.0)]
    second = [Trajectory("c", group_id="g2", status="env_crash", reward=0.5), Trajectory("d", group_id="g2", status="aborted")]
    return [Group("g1", 2, first), Group("g2", 2, second)]


def test_the_step_record_averages_rewards_and_staleness_then_adds_the_learners_metrics():
    step = replace(result(), metrics={"mtp_loss": None, "step_s": 0.75})
    record = step_record(step, groups(), elapsed_s=12.5, push_due=True, pushed_version=6, in_flight=5, ahead=8)
    # reward: the mean over rollouts that have one (the aborted one has none): (1 + 0 + 0.5) / 3
    # staleness: 30 rollouts at lag 0 and 10 at lag 2: mean 20 / 40, max 2
    assert record == {
        "step": 7, "elapsed_s": 12.5, "reward": 0.5, "staleness_mean": 0.5, "staleness_max": 2,
        "push_due": True, "pushed_version": 6, "in_flight": 5, "ahead": 8,
        "version": 7, "stepped": True, "loss": 0.25, "grad_norm": 1.5, "padded": 3,
        "ledger": {"trained": 3, "aborted": 1}, "consistency_warnings": [], "mtp_loss": None, "step_s": 0.75,
    }  # fmt: skip
    # the histogram is summarised, the step's result left alone
    assert "staleness" not in record and step == replace(result(), metrics={"mtp_loss": None, "step_s": 0.75})


def test_a_step_results_record_is_its_typed_fields_then_its_metrics_and_no_push_due():
    assert replace(result(), metrics={"mtp_loss": 0.5}).record() == {
        "version": 7, "stepped": True, "ledger": {"trained": 3, "aborted": 1}, "loss": 0.25, "grad_norm": 1.5, "padded": 3,
        "staleness": {0: 30, 2: 10}, "consistency_warnings": [], "mtp_loss": 0.5,
    }  # fmt: skip


def test_the_step_record_carries_the_loops_push_due_as_given():
    assert not step_record(result(), groups(), elapsed_s=0.0, push_due=False, pushed_version=0, in_flight=0, ahead=0)["push_due"]


def test_a_step_with_no_rewards_and_no_tokens_records_zeros():
    aborted = [Group("g", 1, [Trajectory("x", group_id="g", status="aborted")])]
    record = step_record(replace(result(), staleness={}), aborted, elapsed_s=0.0, push_due=False, pushed_version=0, in_flight=0, ahead=0)
    assert (record["reward"], record["staleness_mean"], record["staleness_max"]) == (0.0, 0.0, 0)


def test_the_batch_record_names_the_rollouts_in_the_order_the_learner_saw_them():
    step = result()
    record = batch_record(step, groups(), learner_version=6, distilled=False)
    assert (record.step, record.learner_version, record.groups) == (7, 6, [["a", "b"], ["c", "d"]])
    assert (record.ledger, record.padded, record.loss, record.grad_norm, record.distilled) == (step.ledger, 3, 0.25, 1.5, False)
    assert record.ledger is not step.ledger  # its own copy of the step's ledger


def test_each_consistency_gap_is_one_warning_naming_the_config_key():
    gaps = [{"task": "coin", "turn": 0, "gap": 0.1234, "tokens": 40}, {"task": "math", "turn": 2, "gap": 1.0, "tokens": 3}]
    assert consistency_warnings(replace(result(), consistency_warnings=gaps)) == [
        "step 7: task 'coin' turn 0: mean |learner - rollout| log-prob 0.123 over 40 tokens > learner.logprob_gap_warning",
        "step 7: task 'math' turn 2: mean |learner - rollout| log-prob 1.000 over 3 tokens > learner.logprob_gap_warning",
    ]
    assert consistency_warnings(result()) == []
