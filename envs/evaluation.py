"""Held-out evaluation of any environment: its own episodes, played greedily, recorded nowhere.

An environment is scored by its own `run_episode` on held-out tasks, so evaluation uses exactly the
reward logic, prompts, tools and sandboxes of training, and exactly its path to the policy: each
episode runs through the gateway (`run_recorded_episode`, the real OpenAI client) in a rollout opened
for evaluation, which the gateway samples greedily whatever temperature the episode asks for and
records nowhere: evaluation rollouts never reach the store, the learner or the ledger. The chat
template and the tool-call parser are the gateway's own; nothing is rendered or parsed here.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from asyncrl.lifecycle import RolloutLifecycle

from .base import Environment, score
from .runner import run_recorded_episode

CONCURRENCY = 64
"""Episodes evaluated at once: enough to fill the engines' batches, few enough sandboxes at a time."""


@dataclass
class TaskEval:
    accuracy: float
    """Mean score (envs/base.py `score`: `correct` when reported, else the reward)."""
    num_problems: int
    statuses: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0


def heldout_tasks(env: Environment, num_problems: int, seed: int) -> list[Any]:
    """The environment's own fixed held-out set when it offers one, else seeded draws from its eval split."""
    if hasattr(env, "heldout_tasks"):
        return list(env.heldout_tasks(num_problems, seed))
    rng = random.Random(seed)
    return [env.sample_task(rng, "eval") for _ in range(num_problems)]


async def evaluate_env(
    env: Environment, gateway: RolloutLifecycle, *, num_problems: int, seed: int, sandboxes: Any = None,
    timeout_s: float = 300.0, http_client: Any = None, task_name: str | None = None,
) -> TaskEval:  # fmt: skip
    """`num_problems` held-out episodes of `env` through `gateway`'s evaluation rollouts.

    `http_client`: shared by the episodes' OpenAI clients (as for training episodes); `task_name`:
    the rollouts' task (default: the environment's name).
    """
    began = time.monotonic()
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(task: Any):
        async with gate:
            _, result = await run_recorded_episode(
                env, task, gateway, group_id="eval", timeout_s=timeout_s, http_client=http_client,
                sandboxes=sandboxes, task_name=task_name, evaluation=True,
            )  # fmt: skip
            return result

    results = await asyncio.gather(*(one(task) for task in heldout_tasks(env, num_problems, seed)))
    statuses: dict[str, int] = {}
    for result in results:
        statuses[result.status] = statuses.get(result.status, 0) + 1
    scores = [score(r) if r.status == "ok" else 0.0 for r in results]
    return TaskEval(sum(scores) / max(len(scores), 1), len(scores), statuses, time.monotonic() - began)
