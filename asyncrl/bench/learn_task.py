"""What the sides of `asyncrl bench learn` outside `asyncrl run` train and are scored on: the config's one
task, as problems, chat messages and a reward, whichever single-turn environment it is.

asyncrl's own sides play the task's episodes through the gateway; the plain loop and TRL call the policy
themselves, so they need the task without its episode: the built-in arithmetic (`tasks.arithmetic`,
answers checked by `envs/arithmetic.verify`) or a dataset file (`env: dataset`, its reward plug-in, e.g.
math-verify). Problems and the held-out set come from the environment itself (same seed, same set as
the run's evaluation), and a reply is scored by the environment's own reward, so every side learns and
is measured on the same thing.
"""

from __future__ import annotations

import math
import random
from typing import Any, cast

from asyncrl.configs.schema import RunConfig


class BenchTask:
    def __init__(self, config: RunConfig) -> None:
        from asyncrl.sched.tasks import TaskMix

        tasks = TaskMix.from_config(config).evaluated(config.eval.num_problems)
        if len(tasks) != 1:
            raise ValueError(f"bench learn trains one task; the config's mix evaluates {len(tasks)}: {[t.name for t, _ in tasks]}")
        ((task, _),) = tasks
        # The reasoning or dataset environment, checked below: typed by what it has beyond the Protocol.
        self.name, self.env = task.name, cast(Any, task.env)
        if self.env.name not in ("reasoning", "dataset") or getattr(self.env, "needs_sandbox", False):
            raise ValueError(
                f"bench learn's plain and TRL sides play single-turn tasks without tools: the reasoning task or a dataset "
                f"file; {self.name} is a {self.env.name!r} environment"
            )
        self.max_tokens: int = self.env.max_tokens
        """Tokens per reply, the environment's own (its episodes ask for as many)."""

    def sample(self, rng: random.Random) -> Any:
        return self.env.sample_task(rng, "train")

    def heldout(self, num_problems: int, seed: int) -> list[Any]:
        from asyncrl.envs.evaluation import heldout_tasks

        return heldout_tasks(self.env, num_problems, seed)

    def messages(self, problem: Any) -> list[dict]:
        messages = problem.messages
        return list(messages() if callable(messages) else messages)

    async def score(self, problem: Any, text: str) -> tuple[float, bool]:
        """(reward, correct) of a reply, as the environment's episode would score it."""
        if self.env.name == "reasoning":
            from asyncrl.envs.arithmetic import verify

            correct = verify(text, problem)
            return (1.0 if correct else 0.0), correct
        scored = await self.env.reward.score(problem.messages, text, problem)
        unparsed = bool(scored.details.get("unparsed", False))
        reward = 0.0 if unparsed or not math.isfinite(scored.reward) else float(scored.reward)
        return reward, bool(scored.details.get("correct", reward >= 1.0)) and not unparsed
