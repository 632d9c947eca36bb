"""Answer rewards loaded by name, as a config names them: math-verify, exact / normalized, regex.

The math reward runs the real math-verify in its worker process (one per test module: it imports
sympy once); a hostile answer is bounded by math-verify's own timeouts and, past them, by the kill.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from asyncrl.envs.dataset.row import DatasetRow
from asyncrl.envs.rewards import RewardError, RewardResult, load_reward
from asyncrl.envs.rewards.answers import MathReward, canonical_number

pytestmark = pytest.mark.timeout(120)


def score(reward, completion: str, answer=None, task=None) -> RewardResult:
    task = task if task is not None else DatasetRow("row-0", [{"role": "user", "content": "?"}], answer=answer)
    return asyncio.run(reward.score([{"role": "user", "content": "?"}], completion, task))


@pytest.fixture(scope="module")
def math() -> MathReward:
    reward = load_reward("math", {"timeout_s": 2})
    assert isinstance(reward, MathReward)
    return reward


@pytest.mark.parametrize(
    "answer, completion",
    [
        ("1/2", "0.5"),
        ("0.5", "1/2"),
        ("1/2", "$\\frac{1}{2}$"),
        ("\\frac{1}{2}", "The answer is 0.5"),
        ("0.5", "First 1+1=2, then we halve it... so \\boxed{\\frac{1}{2}}"),
        ("3", "The answer is 3"),
        ("3", "The answer is 3."),
        (3, "\\boxed{3}"),
        ("x+1", "$1 + x$"),
    ],
)
def test_math_accepts_equivalent_forms(math, answer, completion) -> None:
    result = score(math, completion, answer)
    assert result.reward == 1.0, result
    assert result.details["correct"] and not result.details["unparsed"]


def test_math_prefers_the_boxed_answer_over_earlier_numbers(math) -> None:
    assert score(math, "Try 4: no. Try 5: no. \\boxed{3}", "3").reward == 1.0
    assert score(math, "It is \\boxed{4}, though 3 came up", "3").reward == 0.0


@pytest.mark.parametrize("completion", ["The answer is 4", "\\boxed{\\frac{1}{3}}", "0.55"])
def test_math_wrong_answers_score_zero(math, completion) -> None:
    result = score(math, completion, "1/2")
    assert result.reward == 0.0 and result.details == {**result.details, "correct": False, "unparsed": False}
    assert "extracted" in result.details


@pytest.mark.parametrize("completion", ["I do not know.", "", "\\boxed{}"])
def test_math_unparseable_answers_score_zero_with_the_flag(math, completion) -> None:
    result = score(math, completion, "3")
    assert result.reward == 0.0
    assert result.details["unparsed"] is True and result.details["correct"] is False


def test_math_hostile_answer_is_bounded_and_the_worker_recovers(math) -> None:
    async def hostile_while_the_loop_ticks():
        ticks = 0
        scoring = asyncio.ensure_future(math.score([], "\\boxed{9^{9^{9^{9}}}}", {"answer": "3"}))
        while not scoring.done():
            await asyncio.sleep(0.01)
            ticks += 1
        return scoring.result(), ticks

    # math-verify's own comparison timeout (2 s here) answers "not equal"; the event loop runs on meanwhile.
    result, ticks = asyncio.run(hostile_while_the_loop_ticks())
    assert result.reward == 0.0 and ticks > 10
    # An answer that outlasts the host's limit gets the worker killed: 0, unparsed, timed out; the next answer starts a new one.
    request = dict(gold="3", answer="\\boxed{9^{9^{9^{9}}}}", extract="any", boxed_first=True, anchored=False, timeout=30)
    verdict = asyncio.run(math._worker.check(request, 0.5))
    assert verdict == {"unparsed": True, "timed_out": True}
    assert math._worker._proc is None
    assert score(math, "\\boxed{3}", "3").reward == 1.0
    # A worker that died between answers (the OOM killer) is replaced.
    math._worker._proc.kill()
    math._worker._proc.wait()
    assert score(math, "\\boxed{3}", "3").reward == 1.0


def test_math_reads_dicts_and_objects_and_refuses_an_unusable_reference(math) -> None:
    assert score(math, "\\boxed{2}", task={"answer": "2"}).reward == 1.0
    assert score(math, "\\boxed{2}", task=SimpleNamespace(answer=2)).reward == 1.0
    with pytest.raises(RewardError, match="cannot parse the reference"):
        score(math, "\\boxed{2}", "\\undefinedmacro{")
    with pytest.raises(RewardError, match="no reference answer"):
        score(math, "2", task={"answer": " "})
    with pytest.raises(RewardError, match="'answer'"):
        score(math, "2", task=SimpleNamespace(question="?"))


def test_math_options_choose_the_extraction() -> None:
    with pytest.raises(ValueError, match="extract"):
        load_reward("math", {"extract": "words"})
    with pytest.raises(ValueError, match="timeout_s"):
        load_reward("math", {"timeout_s": 0.5})
    with pytest.raises(TypeError, match="could not be built"):
        load_reward("math", {"format_weight": 0.1})
    anchored = load_reward("math", {"anchored": True, "timeout_s": 2})
    assert score(anchored, "we get 3 apples", "3").details["unparsed"] is True
    assert score(anchored, "The final answer is 3", "3").reward == 1.0


def test_exact_compares_normalized_text_by_default() -> None:
    exact = load_reward("exact")
    assert score(exact, "  Paris \n", "paris").reward == 1.0
    assert score(exact, "New   York", "new york").reward == 1.0
    assert score(exact, "Paris.", "paris").reward == 0.0
    assert score(exact, "1000", "1,000").reward == 0.0  # numbers are text unless asked
    assert score(exact, "lyon", ["Paris", "Lyon"]).reward == 1.0  # a list: any of its answers
    strict = load_reward("exact", {"normalize": False})
    assert score(strict, "Paris", "Paris").reward == 1.0
    assert score(strict, "paris", "Paris").reward == 0.0
    assert score(strict, "Paris ", "Paris").reward == 0.0


def test_exact_number_normalization() -> None:
    numbers = load_reward("exact", {"numbers": True})
    for completion in ["1000", "1,000", "1000.0", "+1000", "1e3", " 1000.00 "]:
        assert score(numbers, completion, "1000").reward == 1.0, completion
    assert score(numbers, "1000.5", "1000").reward == 0.0
    assert score(numbers, "-0.0", 0).reward == 1.0
    cases = {"1,000.50": "1000.5", ".5": "0.5", "5.": "5", "1,00": "1,00", "abc": "abc", "1e200": "1E+200"}
    assert {text: canonical_number(text) for text in cases} == cases


def test_regex_match_mode() -> None:
    shaped = load_reward("regex", {"pattern": r"^Answer: \w+$", "fullmatch": True})
    assert score(shaped, "Answer: yes", "unused").reward == 1.0
    assert score(shaped, "Answer: yes, I think", "unused").reward == 0.0
    # No pattern option: each row's answer is its pattern.
    per_row = load_reward("regex", {"ignore_case": True})
    assert score(per_row, "The colour is RED", r"\bred\b").reward == 1.0
    assert score(per_row, "The colour is reddish", r"\bred\b").details == {"correct": False, "unparsed": False}
    with pytest.raises(RewardError, match="invalid regular expression"):
        score(per_row, "x", "(unclosed")
    with pytest.raises(ValueError, match="invalid regular expression"):
        load_reward("regex", {"pattern": "(unclosed"})


def test_regex_extract_mode_compares_the_extracted_answer() -> None:
    hashes = load_reward("regex", {"pattern": r"####\s*(?P<answer>[-\d.,]+)", "mode": "extract", "numbers": True})
    result = score(hashes, "48 + 24 = 72\n#### 7\nno wait\n#### 72", "72")
    assert result.reward == 1.0 and result.details["extracted"] == "72"
    assert score(hashes, "#### 1,000", "1000").reward == 1.0
    missing = score(hashes, "the answer is 72", "72")
    assert missing.reward == 0.0 and missing.details["unparsed"] is True
    first = load_reward("regex", {"pattern": r"answer: (\w+)", "mode": "extract", "which": "first"})
    assert score(first, "answer: Yes ... answer: no", "yes").reward == 1.0
    with pytest.raises(ValueError, match="needs a pattern"):
        load_reward("regex", {"mode": "extract"})
