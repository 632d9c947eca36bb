"""The task every side of `asyncrl bench learn` outside `asyncrl run` trains on: the config's one single-turn
task, scored by the environment's own reward, on the held-out set the run evaluates."""

from __future__ import annotations

import asyncio
import random

import pytest

from asyncrl.bench.learn_task import BenchTask
from asyncrl.configs import load_config
from asyncrl.envs.evaluation import heldout_tasks
from asyncrl.sched.tasks import TaskMix


def test_the_arithmetic_task_is_checked_by_its_own_verify():
    task = BenchTask(load_config("quickstart", ["eval.num_problems=20"]))
    problem = task.sample(random.Random(0))
    assert task.messages(problem) == problem.messages() and task.max_tokens == 16
    assert asyncio.run(task.score(problem, str(problem.answer))) == (1.0, True)
    assert asyncio.run(task.score(problem, f"the answer is {problem.answer}")) == (0.0, False)


def test_a_dataset_task_is_scored_by_its_reward_on_the_runs_held_out_set():
    pytest.importorskip("math_verify")
    config = load_config("smollm2", ["eval.num_problems=30", "policy.path=null"])
    task = BenchTask(config)
    ((run_task, _),) = TaskMix.from_config(config).evaluated(30)
    held = task.heldout(30, config.eval.seed)
    assert [p.row_id for p in held] == [p.row_id for p in heldout_tasks(run_task.env, 30, config.eval.seed)]
    problem = held[0]
    assert task.max_tokens == 48 and task.messages(problem)[-1]["content"] == problem.messages[-1]["content"]
    answer = problem.answer if isinstance(problem.answer, str) else problem.answer[0]
    # math-verify on the whole reply: a sentence ending in the right number is right, another number is not.
    assert asyncio.run(task.score(problem, f"So each friend gets {answer}.")) == (1.0, True)
    assert asyncio.run(task.score(problem, f"So each friend gets {int(answer) + 1}.")) == (0.0, False)


def test_a_task_with_tools_or_several_tasks_is_refused_with_why():
    with pytest.raises(ValueError, match="single-turn tasks without tools: the reasoning task or a dataset file; agentic"):
        BenchTask(load_config("agentic", ["eval.num_problems=4"]))
    with pytest.raises(ValueError, match="bench learn trains one task"):
        BenchTask(load_config("mixed", ["eval.num_problems=8"]))
