"""Echo a digit: the smallest environment worth training on.

The prompt names a digit; the reward is 1 when the reply contains it. Even a random policy hits it
now and then, so GRPO groups have signal from the first step.
"""

from __future__ import annotations

import random

from asyncrl.envs.base import EpisodeResult


class EchoDigitEnv:
    name = "echo-digit"

    def __init__(self, max_tokens: int = 4) -> None:
        self.max_tokens = max_tokens

    def sample_task(self, rng: random.Random, split: str = "train") -> int:
        # Even digits train, odd digits are held out.
        return rng.randrange(0, 10, 2) if split == "train" else rng.randrange(1, 10, 2)

    async def run_episode(self, task: int, client) -> EpisodeResult:
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": f"Say {task}"}], max_tokens=self.max_tokens
        )
        correct = str(task) in (reply.choices[0].message.content or "")
        return EpisodeResult(reward=float(correct), metrics={"correct": correct})
