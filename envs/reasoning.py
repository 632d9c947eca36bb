"""The reasoning environment: one arithmetic or word problem per episode, reward 1 for the exact answer.

It talks to the policy through the gateway like any agent: a single chat call with the problem as
the user message, then `verify` on the reply.
"""

from __future__ import annotations

import random

from asyncrl.configs.context import EnvContext
from asyncrl.configs.schema import ArithmeticTaskConfig

from .arithmetic import ArithmeticTask, Problem, verify
from .base import Demonstration, EpisodeResult, Split


class ReasoningEnv:
    name = "reasoning"

    def __init__(self, config: ArithmeticTaskConfig, *, max_tokens: int = 16, temperature: float = 1.0) -> None:
        self.task = ArithmeticTask(config)
        self.max_tokens = max_tokens
        self.temperature = temperature

    @classmethod
    def from_config(cls, context: EnvContext, **options) -> ReasoningEnv:
        """`tasks.arithmetic` with `options` overriding its fields; the run's answer budget and temperature."""
        task = ArithmeticTaskConfig(**{**context.tasks.arithmetic.model_dump(), **options})
        # The learner scores tokens at rollout.sampling.temperature; episodes must sample at the same one.
        return cls(task, max_tokens=context.episode_max_tokens, temperature=context.sampling.temperature)

    def sample_task(self, rng: random.Random, split: Split = "train") -> Problem:
        return self.task.sample(rng, heldout=split == "eval")

    def heldout_tasks(self, num_problems: int, seed: int) -> list[Problem]:
        """Distinct held-out problems (drawn with replacement, the few one-digit sums would repeat)."""
        return self.task.heldout_set(num_problems, seed)

    def demonstration(self, rng: random.Random) -> Demonstration:
        """A training-split problem and its bare answer."""
        return Demonstration(self.task.sample(rng).demonstration())

    async def run_episode(self, task: Problem, client) -> EpisodeResult:
        # `client.chat.completions.create` sends this same request; the client's plain `post` skips the
        # SDK's pass over the typed parameters and its response models, a quarter of the driver's CPU
        # per episode (docs/BENCHMARKS.md, "learn"). Same route, same recording, same reply as JSON.
        body = {"model": "policy", "messages": task.messages(), "max_tokens": self.max_tokens, "temperature": self.temperature}
        reply = await client.post("/chat/completions", cast_to=object, body=body)
        choice = reply["choices"][0]
        answer = choice["message"]["content"] or ""
        correct = verify(answer, task)
        metrics = {"correct": correct, "finish_reason": choice["finish_reason"], "completion_tokens": reply["usage"]["completion_tokens"]}
        return EpisodeResult(reward=1.0 if correct else 0.0, metrics=metrics)
