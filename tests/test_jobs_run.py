"""summary.json's per-task held-out accuracy, read from the loop's metrics records."""

from __future__ import annotations

from asyncrl.jobs.run import eval_by_task


def test_each_task_has_its_first_and_last_evaluation():
    records = [
        {"step": 0, "eval_accuracy": 0.3, "eval_accuracy/agentic": 0.4, "eval_accuracy/reasoning": 0.2},
        {"step": 1, "loss": 0.5, "reward": 0.1},
        {"step": 10, "eval_accuracy": 0.5, "eval_accuracy/agentic": 0.7, "eval_accuracy/reasoning": 0.3},
        {"step": 20, "eval_accuracy": 0.6, "eval_accuracy/agentic": 0.8, "eval_accuracy/reasoning": 0.4},
    ]
    assert eval_by_task(records, ["agentic", "reasoning"]) == {
        "eval_before_by_task": {"agentic": 0.4, "reasoning": 0.2},
        "eval_after_by_task": {"agentic": 0.8, "reasoning": 0.4},
    }


def test_a_lone_task_is_its_overall_accuracy():
    records = [{"step": 0, "eval_accuracy": 0.415}, {"step": 5, "loss": 1.0}, {"step": 43, "eval_accuracy": 0.69}]
    assert eval_by_task(records, ["agentic"]) == {"eval_before_by_task": {"agentic": 0.415}, "eval_after_by_task": {"agentic": 0.69}}


def test_no_evaluation_gives_none():
    records = [{"step": 0, "eval_accuracy": None}, {"step": 1, "loss": 1.0}]
    assert eval_by_task(records, []) == {"eval_before_by_task": None, "eval_after_by_task": None}
