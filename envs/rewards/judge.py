"""A generative reward model: an LLM judge grades the answer by a rubric, through any OpenAI-compatible
endpoint (a second `asyncrl serve`, vLLM, a hosted API) called with the official `openai` client.

The rubric is a prompt template with `{instruction}` (the last user message the policy saw) and
`{response}` (its answer); it asks the judge to end with `score: N` on a 0..max_score scale, and
reward = N / max_score.

Reading the verdict (`parse_verdict`): the last `score: N` (also `score = N`, `Score:N/10`, any case)
wins, so a judge that reasons first and scores last is read right; a verdict that is only a number
counts as that number. A verdict with no such score, or a score outside [0, max_score], is
*unparseable*: the episode ends as env_crash (reason: the verdict's first 200 characters) and the
learner drops it. It does not become a zero reward, because a judge's formatting slip says nothing
about the policy's answer. A judge call that times out or fails ends the same way.
"""

from __future__ import annotations

import os
import re
from typing import Any

import openai

from asyncrl.configs.context import EnvContext
from asyncrl.configs.schema import JudgeRewardConfig

from .base import PerLoop, RewardError, RewardResult

DEFAULT_RUBRIC = (
    "Grade the response to the instruction. Check every constraint the instruction states "
    "(required and forbidden words, number of words, casing, ending). Give 10 if all are met, "
    "0 if none are, proportionally in between.\n"
    "Instruction: {instruction}\nResponse: {response}\n"
    "End your answer with 'score: N'."
)
_SCORE = re.compile(r"score\s*[:=]\s*([+-]?\d+(?:\.\d+)?)(?:\s*/\s*\d+(?:\.\d+)?)?", re.IGNORECASE)
_NUMBER = re.compile(r"\s*([+-]?\d+(?:\.\d+)?)\s*")


class UnparseableVerdict(RewardError):
    """The judge answered, but not with a score on its scale."""


class JudgeReward:
    def __init__(self, config: JudgeRewardConfig | None = None) -> None:
        self.config = config or JudgeRewardConfig()
        self.rubric = self.config.rubric or DEFAULT_RUBRIC
        self._client: PerLoop[openai.AsyncOpenAI] = PerLoop(self._new_client)

    @classmethod
    def from_config(cls, context: EnvContext, **options: Any) -> JudgeReward:
        """`rewards.judge` with `options` overriding its fields."""
        return cls(JudgeRewardConfig(**{**context.rewards.judge.model_dump(), **options}))

    def _new_client(self) -> openai.AsyncOpenAI:
        c = self.config
        # Local servers (vLLM, asyncrl serve without auth) accept any key; the openai client insists on one.
        api_key = os.environ.get(c.api_key_env) or "EMPTY"
        return openai.AsyncOpenAI(base_url=c.base_url, api_key=api_key, timeout=c.timeout_s, max_retries=c.max_retries)

    def prompt(self, prompt_messages: list[dict], completion_text: str) -> str:
        instruction = next((m.get("content") or "" for m in reversed(prompt_messages) if m.get("role") == "user"), "")
        return self.rubric.format(instruction=instruction, response=completion_text)

    async def score(self, prompt_messages: list[dict], completion_text: str, task: Any) -> RewardResult:
        c = self.config
        try:
            reply = await self._client.get().chat.completions.create(
                model=c.model, messages=[{"role": "user", "content": self.prompt(prompt_messages, completion_text)}],
                max_tokens=c.max_tokens, temperature=c.temperature,
            )  # fmt: skip
        except openai.APITimeoutError as error:
            raise RewardError(f"judge at {c.base_url} gave no verdict within {c.timeout_s} s") from error
        except openai.APIError as error:
            # Wrapped: left as an openai.APIError the runner would blame the policy's call (status error).
            raise RewardError(f"judge at {c.base_url} failed: {type(error).__name__}: {error}") from error
        verdict = (reply.choices[0].message.content or "") if reply.choices else ""
        value = parse_verdict(verdict, c.max_score)
        if value is None:
            raise UnparseableVerdict(f"judge verdict has no score in [0, {c.max_score:g}]: {verdict[:200]!r}")
        return RewardResult(value / c.max_score, {"judge_score": value, "verdict": verdict[:200]})


def parse_verdict(verdict: str, max_score: float) -> float | None:
    """The judge's score, or None when the verdict holds no score in [0, max_score] (module docstring)."""
    matches = _SCORE.findall(verdict)
    if matches:
        text = matches[-1]
    else:
        bare = _NUMBER.fullmatch(verdict)
        if bare is None:
            return None
        text = bare.group(1)
    value = float(text)
    return value if 0.0 <= value <= max_score else None
