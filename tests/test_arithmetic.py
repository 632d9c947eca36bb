"""The built-in tasks: held-out split, answer verification, determinism, tool-call demonstrations."""

from __future__ import annotations

import random

import pytest

from asyncrl.configs.schema import ArithmeticTaskConfig
from asyncrl.envs.arithmetic import WORD_TEMPLATES, ArithmeticTask, Problem, is_heldout, verify
from asyncrl.envs.tool_demos import ToolProblem, sample_tool_problem


def test_training_never_yields_a_heldout_problem_even_reworded():
    config = ArithmeticTaskConfig(min_digits=1, max_digits=2, heldout_fraction=0.2)
    task = ArithmeticTask(config)
    rng = random.Random(0)
    train = {task.sample(rng).canonical for _ in range(5000)}
    heldout = {p.canonical for p in task.heldout_set(300, seed=1)}
    assert train and heldout
    assert not train & heldout
    assert all(not is_heldout(c, 0.2) for c in train)
    # The split is decided on the canonical problem, so no phrasing leaks a held-out problem.
    p = task.heldout_set(1, seed=1)[0]
    for template in range(len(WORD_TEMPLATES[p.op])):
        assert is_heldout(Problem(p.a, p.b, p.op, template).canonical, 0.2)


def test_heldout_share_of_the_problem_space_matches_the_config():
    task = ArithmeticTask(ArithmeticTaskConfig(min_digits=1, max_digits=3, heldout_fraction=0.1))
    rng = random.Random(3)
    draws = [task._draw(rng).canonical for _ in range(20000)]
    share = sum(is_heldout(c, 0.1) for c in draws) / len(draws)
    assert 0.08 < share < 0.12


def test_heldout_set_holds_distinct_problems_and_says_when_the_split_is_too_small():
    task = ArithmeticTask(ArithmeticTaskConfig(min_digits=1, max_digits=2, heldout_fraction=0.1))
    problems = task.heldout_set(200, seed=4)
    assert len(problems) == 200 == len({p.canonical for p in problems})
    tiny = ArithmeticTask(ArithmeticTaskConfig(min_digits=1, max_digits=1, heldout_fraction=0.1))
    with pytest.raises(ValueError, match="too few distinct problems"):
        tiny.heldout_set(500, seed=4)


def test_subtraction_share_follows_the_config():
    for fraction in (0.0, 0.5):
        task = ArithmeticTask(ArithmeticTaskConfig(subtraction_fraction=fraction))
        rng = random.Random(2)
        share = sum(task.sample(rng).op == "-" for _ in range(4000)) / 4000
        assert abs(share - fraction) < 0.03


def test_problems_are_deterministic_from_the_seed():
    task = ArithmeticTask(ArithmeticTaskConfig())
    first = [task.sample(random.Random(7)) for _ in range(3)]
    assert first == [task.sample(random.Random(7)) for _ in range(3)]
    assert task.heldout_set(50, seed=1) == task.heldout_set(50, seed=1)
    assert task.heldout_set(50, seed=1) != task.heldout_set(50, seed=2)


def test_operands_answers_and_phrasing():
    config = ArithmeticTaskConfig(min_digits=2, max_digits=4, word_problem_fraction=0.5)
    task = ArithmeticTask(config)
    rng = random.Random(11)
    problems = [task.sample(rng) for _ in range(2000)]
    assert all(2 <= len(str(n)) <= 4 for p in problems for n in (p.a, p.b))
    assert all(p.answer >= 0 for p in problems)
    assert {p.op for p in problems} == {"+", "-"}
    words = [p for p in problems if p.template is not None]
    assert 0.4 < len(words) / len(problems) < 0.6
    assert all(str(p.a) in p.prompt and str(p.b) in p.prompt for p in words)
    bare = next(p for p in problems if p.template is None)
    assert bare.prompt == bare.canonical
    assert bare.demonstration() == [
        {"role": "user", "content": bare.canonical},
        {"role": "assistant", "content": str(bare.answer)},
    ]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("46", True),
        (" 46\n", True),
        ("46<|endoftext|>", True),
        ("46 <|endoftext|> ", True),
        ("+46", True),
        ("47", False),
        ("4 6", False),
        ("46.0", False),
        ("The answer is 46", False),
        ("46<|endoftext|>46", False),
        ("", False),
        ("<|endoftext|>", False),
    ],
)
def test_verify_is_an_exact_integer_match(text, expected):
    assert verify(text, Problem(12, 34, "+")) is expected


def test_verify_subtraction():
    assert verify("7", Problem(10, 3, "-"))
    assert not verify("13", Problem(10, 3, "-"))


def test_tool_demonstration_shape():
    problem = ToolProblem(123, 4567)
    messages = problem.demonstration()
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    call = messages[1]["tool_calls"][0]["function"]
    assert call == {"name": "python", "arguments": {"code": "print(123*4567)"}}
    assert messages[2]["content"] == messages[3]["content"] == str(123 * 4567)
    rng = random.Random(0)
    operands = [n for _ in range(500) for n in (lambda p: (p.a, p.b))(sample_tool_problem(rng))]
    assert min(operands) >= 100 and max(operands) <= 99999
