"""An environment with a bug that `asyncrl replay episode` finds (docs/REPLAY.md walks through it).

It is the built-in reasoning task, except that half of its prompts start with "Please:". The choice
is drawn from Python's process-wide `random` module instead of from the task, so the same task
gives a different prompt when it is played again: the environment is not deterministic, and a
policy trained on it sees a prompt distribution that no seed reproduces.
"""

from __future__ import annotations

import random

from asyncrl.envs.arithmetic import Problem, verify
from asyncrl.envs.base import EpisodeResult
from asyncrl.envs.reasoning import ReasoningEnv


class NoisyReasoning(ReasoningEnv):
    name = "noisy_reasoning"

    async def run_episode(self, task: Problem, client) -> EpisodeResult:
        prompt = task.prompt
        if random.random() < 0.5:  # the bug: not drawn from the task
            prompt = "Please: " + prompt
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": prompt}], max_tokens=self.max_tokens, temperature=self.temperature
        )
        answer = reply.choices[0].message.content or ""
        correct = verify(answer, task)
        return EpisodeResult(reward=1.0 if correct else 0.0, metrics={"correct": correct})
