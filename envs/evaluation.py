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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.lifecycle import RolloutLifecycle

from .base import Environment, EpisodeResult, score
from .pass_at_k import mean_and_interval, per_problem
from .runner import run_recorded_episode

CONCURRENCY = 64
"""Episodes evaluated at once: enough to fill the engines' batches, few enough sandboxes at a time."""


@dataclass
class TaskEval:
    accuracy: float
    """Mean score over every episode (envs/base.py `score`: `correct` when reported, else the reward)."""
    num_problems: int
    statuses: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    samples: int = 1
    """Episodes per problem."""
    successes: list[int] = field(default_factory=list)
    """Per problem, in held-out order: its episodes that succeeded (a score of 1: solved, not partly)."""
    reasons: dict[str, str] = field(default_factory=dict)
    """The first reason given for each status other than ok (what to fix when evaluation fails)."""
    problem_scores: list[float] = field(default_factory=list)
    """Per problem, the mean score of its episodes (`accuracy` is their mean)."""

    @property
    def failed(self) -> int:
        """Episodes that did not end ok (a crash, a timeout, an engine gone): each scored 0."""
        return sum(count for status, count in self.statuses.items() if status != "ok")

    def pass_at(self, k: int, *, seed: int = 0) -> tuple[float, float, float]:
        """(pass@k, low, high): the unbiased estimate over problems and its 95% bootstrap interval."""
        return mean_and_interval(per_problem(self.successes, self.samples, k), seed=seed)

    def accuracy_interval(self, *, seed: int = 0) -> tuple[float, float]:
        """The 95% bootstrap interval of `accuracy` over problems (pass@1's own where scores are 0 or 1)."""
        return mean_and_interval(np.array(self.problem_scores), seed=seed)[1:]


def heldout_tasks(env: Environment, num_problems: int, seed: int) -> list[Any]:
    """The environment's own fixed held-out set when it offers one, else seeded draws from its eval split."""
    if hasattr(env, "heldout_tasks"):
        return list(env.heldout_tasks(num_problems, seed))
    rng = random.Random(seed)
    return [env.sample_task(rng, "eval") for _ in range(num_problems)]


async def evaluate_env(
    env: Environment, gateway: RolloutLifecycle, *, num_problems: int, seed: int, sandboxes: Any = None,
    timeout_s: float = 300.0, http_client: Any = None, task_name: str | None = None, samples: int = 1, sampled: bool = False,
) -> TaskEval:  # fmt: skip
    """`num_problems` held-out problems of `env`, `samples` episodes each, through `gateway`'s evaluation
    rollouts: greedy, or with `sampled` as the environment asks (its temperature: pass@k).

    `http_client`: shared by the episodes' OpenAI clients (as for training episodes); `task_name`:
    the rollouts' task (default: the environment's name).
    """

    async def one(task: Any) -> EpisodeResult:
        _, result = await run_recorded_episode(
            env, task, gateway, group_id="eval", timeout_s=timeout_s, http_client=http_client,
            sandboxes=sandboxes, task_name=task_name, evaluation=True, sampled=sampled,
        )  # fmt: skip
        return result

    return await play_heldout(env, one, num_problems=num_problems, seed=seed, samples=samples)


async def play_heldout(
    env: Environment, play: Callable[[Any], Awaitable[EpisodeResult]], *, num_problems: int, seed: int, samples: int = 1
) -> TaskEval:
    """`samples` episodes of each of `env`'s held-out problems, each played by `play` (through a gateway's
    evaluation rollouts, or straight against a server), `CONCURRENCY` at a time, counted."""
    began = time.monotonic()
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(task: Any) -> EpisodeResult:
        async with gate:
            return await play(task)

    tasks = heldout_tasks(env, num_problems, seed)
    results = await asyncio.gather(*(one(task) for task in tasks for _ in range(samples)))
    return tally(list(results), samples, time.monotonic() - began)


def tally(results: list[EpisodeResult], samples: int, wall_s: float) -> TaskEval:
    """`results` of consecutive runs of `samples` episodes per problem, counted."""
    statuses: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for result in results:
        statuses[result.status] = statuses.get(result.status, 0) + 1
        if result.status != "ok":
            reasons.setdefault(result.status, result.reason)
    scores = [score(r) if r.status == "ok" else 0.0 for r in results]
    chunks = [scores[i : i + samples] for i in range(0, len(scores), samples)]
    successes = [sum(s >= 1.0 for s in chunk) for chunk in chunks]
    problem_scores = [sum(chunk) / len(chunk) for chunk in chunks]
    return TaskEval(sum(scores) / max(len(scores), 1), len(chunks), statuses, wall_s, samples, successes, reasons, problem_scores)
