"""Small verifiers environments, written as a verifiers user writes them, for tests/test_verifiers_env.py.

Each `load_*` function is what an environment module's `load_environment` would be; the tests name
them by import path (`verifiers_envs:load_single_turn`), as a config does.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def _sums(count: int) -> Dataset:
    return Dataset.from_list([{"question": f"{i}+{i % 7}", "answer": str(i + i % 7)} for i in range(count)])


def _text(completion) -> str:
    if isinstance(completion, list):
        return (completion[-1]["content"] or "") if completion else ""
    return completion or ""


def exact_answer(completion, answer, **_) -> float:
    """1 when the last assistant message is the answer, stripped."""
    return float(_text(completion).strip() == answer)


def odd_length(completion, **_) -> float:
    """A reward a random policy gets half the time, so that its groups have something to learn."""
    return float(len(_text(completion)) % 2)


def replied(completion, **_) -> float:
    return float(bool(completion))


def load_single_turn(rows: int = 50, eval_rows: int = 0, reward: str = "exact_answer") -> vf.Environment:
    data = _sums(rows + eval_rows)
    split = {"dataset": data.select(range(rows))}
    if eval_rows:
        split["eval_dataset"] = data.select(range(rows, rows + eval_rows))
    rubric = vf.Rubric(funcs=[{"exact_answer": exact_answer, "odd_length": odd_length}[reward], replied], weights=[1.0, 0.0])
    return vf.SingleTurnEnv(**split, system_prompt="Add the numbers.", rubric=rubric)


class GuessEnv(vf.MultiTurnEnv):
    """Guess a digit: the environment answers 'higher', 'lower' or 'correct' until it is guessed."""

    async def env_response(self, messages, state, **kwargs):
        guess = _last_reply(state)
        return [vf.UserMessage(content="higher" if guess < state["answer"] else "lower")]

    @vf.stop
    async def solved(self, state) -> bool:
        return bool(state["trajectory"]) and _last_reply(state) == state["answer"]


def _last_reply(state) -> str:
    completion = state["trajectory"][-1]["completion"]
    return (completion[-1].content or "").strip()


def guessed(state, **_) -> float:
    return float(bool(state["trajectory"]) and _last_reply(state) == state["answer"])


def load_multi_turn(max_turns: int = 3) -> vf.Environment:
    data = Dataset.from_list([{"question": f"Guess my digit (#{i}).", "answer": str(i % 10)} for i in range(40)])
    return GuessEnv(dataset=data, max_turns=max_turns, rubric=vf.Rubric(funcs=[guessed]))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return int(a) + int(b)


def load_tool_env(max_turns: int = 3) -> vf.Environment:
    return vf.ToolEnv(dataset=_sums(40), tools=[add], max_turns=max_turns, rubric=vf.Rubric(funcs=[exact_answer]))


class BrokenEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        raise RuntimeError("the environment's own bug")


def load_broken() -> vf.Environment:
    return BrokenEnv(dataset=_sums(20), max_turns=3, rubric=vf.Rubric(funcs=[replied]))


def load_group_rubric() -> vf.Environment:
    def best_of_group(completions, **_) -> list[float]:
        return [1.0] * len(completions)

    return vf.SingleTurnEnv(dataset=_sums(20), rubric=vf.Rubric(funcs=[best_of_group]))
