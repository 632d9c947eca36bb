"""The reasoning environment: one arithmetic or word problem per episode, reward 1 for the exact answer.

It talks to the policy through the gateway like any agent: a single chat call with the problem as
the user message, then `verify` on the reply.
"""

from __future__ import annotations

import random

from asyncrl.configs.schema import ArithmeticTaskConfig

from .arithmetic import ArithmeticTask, Problem, verify
from .base import EpisodeResult, Split


class ReasoningEnv:
    name = "reasoning"

    def __init__(self, config: ArithmeticTaskConfig, *, max_tokens: int = 16, temperature: float = 1.0) -> None:
        self.task = ArithmeticTask(config)
        self.max_tokens = max_tokens
        self.temperature = temperature

    def sample_task(self, rng: random.Random, split: Split = "train") -> Problem:
        return self.task.sample(rng, heldout=split == "eval")

    async def run_episode(self, task: Problem, client) -> EpisodeResult:
        reply = await client.chat.completions.create(
            model="policy", messages=task.messages(), max_tokens=self.max_tokens, temperature=self.temperature
        )
        choice = reply.choices[0]
        answer = choice.message.content or ""
        correct = verify(answer, task)
        return EpisodeResult(
            reward=1.0 if correct else 0.0,
            metrics={"correct": correct, "finish_reason": choice.finish_reason, "completion_tokens": reply.usage.completion_tokens},
        )
