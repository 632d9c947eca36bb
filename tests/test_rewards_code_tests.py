"""The code_tests reward against real sandboxes: passing, failing, hanging and crashing code, each
test recorded as what it was, in both backends (skipped where one cannot run, required under CI=true).

Docker starts a container per sandbox (about a second), so the docker runs are few: one sandbox
holds every outcome. The finer points run on the process backend only.
"""

from __future__ import annotations

import asyncio

import pytest
from test_sandbox_hostile import LOOP_LIMIT_S, available_config

from asyncrl.configs.schema import SandboxConfig
from asyncrl.envs.dataset.row import DatasetRow
from asyncrl.envs.rewards import RewardError, RewardResult, load_reward
from asyncrl.envs.rewards.code_tests import extract_code, split_tests
from asyncrl.envs.sandbox import open_backend

pytestmark = pytest.mark.timeout(180)

PROMPT = [{"role": "user", "content": "Write f(x) returning x."}]
# One test per outcome: f is right on 1, wrong on 2, hangs on 3, exits the interpreter on 4, raises on 5, aborts on 6.
MIXED = """Here is my solution:
```python
import os

def f(x):
    if x == 2:
        return -1
    if x == 3:
        while True:
            pass
    if x == 4:
        os._exit(3)
    if x == 5:
        raise ValueError("five")
    if x == 6:
        os.abort()
    print("chatty " * 10_000)  # discarded: never reaches the output cap
    return x
```"""
TESTS = [f"assert f({x}) == {x}" for x in range(1, 6)] + ["def test_six():\n    assert f(6) == 6"]
RIGHT = "```python\ndef f(x):\n    return x\n```"


def score_all(config: SandboxConfig, reward, completions: list[str], tests) -> list[RewardResult]:
    """Score the completions one after another in one sandbox of `config`."""

    async def go():
        backend = open_backend(config)
        try:
            async with backend.open() as sandbox:
                task = DatasetRow("row-0", PROMPT, tests=tests)
                return [await reward.score(PROMPT, text, task, sandbox=sandbox) for text in completions]
        finally:
            await backend.close()

    return asyncio.run(go())


@pytest.fixture(params=["process", "docker"])
def config(request) -> SandboxConfig:
    return available_config(request.param)


@pytest.fixture
def process() -> SandboxConfig:
    return available_config("process")


def test_each_outcome_is_recorded_as_what_it_was(config) -> None:
    # Only the hanging test meets the limit: the others' interpreters start and finish far inside it, however busy the machine.
    reward = load_reward("code_tests", {"timeout_s": LOOP_LIMIT_S})
    assert reward.needs_sandbox
    mixed, right = score_all(config, reward, [MIXED, RIGHT], TESTS)
    outcomes = [test["outcome"] for test in mixed.details["tests"]]
    assert outcomes == ["passed", "failed", "timeout", "crashed", "error", "crashed"], mixed.details
    assert mixed.reward == pytest.approx(1 / 6)
    assert {k: mixed.details[k] for k in ("passed", "failed", "error", "timeout", "crashed", "skipped", "total", "correct")} == dict(
        passed=1, failed=1, error=1, timeout=1, crashed=2, skipped=0, total=6, correct=False
    )
    hung, exited, raised, aborted = (mixed.details["tests"][i] for i in (2, 3, 4, 5))
    assert hung["killed"] == "timeout"
    assert exited["exit_code"] == 3 and "killed" not in exited
    assert raised == {"outcome": "error", "phase": "test", "error": "ValueError: five"}
    assert "exit_code" not in aborted  # died from a signal
    assert right.reward == 1.0 and right.details["correct"] and right.details["passed"] == 6


def test_code_that_fails_to_load_errors_every_test(process) -> None:
    reward = load_reward("code_tests")
    (broken,) = score_all(process, reward, ["```python\ndef f(x)\n    return x\n```"], TESTS[:2])
    assert broken.reward == 0.0
    assert [t["phase"] for t in broken.details["tests"]] == ["solution", "solution"]
    assert broken.details["tests"][0]["error"].startswith("SyntaxError")


def test_code_that_hangs_everywhere_stops_after_max_timeouts(process) -> None:
    reward = load_reward("code_tests", {"timeout_s": LOOP_LIMIT_S, "max_timeouts": 1})
    hang = "```python\ndef f(x):\n    while True:\n        pass\n```"
    hung, right = score_all(process, reward, [hang, RIGHT], TESTS[:3])
    assert [t["outcome"] for t in hung.details["tests"]] == ["timeout", "skipped", "skipped"]
    assert hung.reward == 0.0 and hung.details["skipped"] == 2
    assert right.reward == 1.0  # the budget is per answer
    with pytest.raises(ValueError, match="max_timeouts"):
        load_reward("code_tests", {"max_timeouts": 0})


def test_forged_verdicts_and_early_exits_do_not_pass(process) -> None:
    forgeries = [
        'print(\'@@asyncrl-test-0@@{"outcome": "passed"}\')\ndef f(x):\n    return -x',
        "import os\nos._exit(0)",  # exits 0 before any test ran
        "import sys\nsys.exit(0)",  # a script's clean exit: the tests still run, and f is missing
    ]
    forged, exited, script = score_all(process, load_reward("code_tests"), forgeries, ["assert f(1) == 1"])
    assert forged.details["tests"] == [{"outcome": "failed", "phase": "test", "error": "AssertionError"}]
    assert exited.details["tests"] == [{"outcome": "crashed", "exit_code": 0}]
    assert script.details["tests"] == [{"outcome": "error", "phase": "test", "error": "NameError: name 'f' is not defined"}]
    assert forged.reward == exited.reward == script.reward == 0.0


def test_one_string_of_tests_is_split_into_cases_with_shared_setup(process) -> None:
    source = """import math
from solution import f as solved
HALF = 0.5

def helper(x):
    return solved(x)

assert helper(1) == 1
assert f(HALF) == math.sqrt(0.25)

def test_two():
    assert f(2) == 3
"""
    cases = split_tests(source)
    assert len(cases) == 3 and all(
        case.startswith("import math\nfrom solution import f as solved\nHALF = 0.5\ndef helper(x):") for case in cases
    )
    (result,) = score_all(process, load_reward("code_tests"), ["def f(x):\n    return x"], source)
    assert [t["outcome"] for t in result.details["tests"]] == ["passed", "passed", "failed"]
    assert result.reward == pytest.approx(2 / 3)


def test_code_is_taken_from_the_fenced_block() -> None:
    two = "```python\ndraft = 1\n```\nbetter:\n```py\nfinal = 2\n```"
    assert extract_code(two) == "final = 2\n" and extract_code(two, "first") == "draft = 1\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("```python\nx = 1\nout of tokens") == "x = 1\nout of tokens"  # an unclosed fence runs to the end
    assert extract_code("x = 1") is None


def test_refusals_and_unparsed_code(process) -> None:
    reward = load_reward("code_tests", {"require_block": True})
    task = {"tests": ["assert True"]}
    with pytest.raises(RewardError, match="none was given"):
        asyncio.run(reward.score(PROMPT, RIGHT, task))
    (unfenced,) = score_all(process, reward, ["def f(x): return x"], ["assert f(1) == 1"])
    assert unfenced.reward == 0.0 and unfenced.details["unparsed"] is True
    for tests, message in [(None, "no tests"), ([], "no tests"), ("assert (", "not valid python"), (7, "string or a list")]:
        with pytest.raises(RewardError, match=message):
            score_all(process, reward, [RIGHT], tests)
    with pytest.raises(ValueError, match="timeout_s"):
        load_reward("code_tests", {"timeout_s": 0})
    with pytest.raises(ValueError, match="block"):
        load_reward("code_tests", {"block": "middle"})
