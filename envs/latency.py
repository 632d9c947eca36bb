"""Heavy-tailed episode durations: any environment, plus a simulated tool latency per episode.

Agentic episodes spend most of their wall time outside the policy (tools, sandboxes, test suites),
and a few take far longer than the rest. `LatencyEnv` reproduces that on top of another
environment: each episode also waits a latency drawn from `LatencyDistribution`, a lognormal body
with a Pareto tail (infinite variance for tail_alpha <= 2), capped. The wait is an asyncio sleep,
so it costs no CPU: what it measures is how well a loop hides latency, not how fast it computes.
Rewards, statuses, the model calls and the sandbox (for a wrapped environment that needs one) are
the wrapped environment's own.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any, Literal

from pydantic import Field

from asyncrl.configs.schema import Section

from .base import Environment, EpisodeResult, Split, needs_sandbox


class LatencyConfig(Section):
    """The simulated tool latency of each episode."""

    median_s: float = Field(0.5, gt=0.0, le=3600.0)
    """Median of the lognormal body, in seconds."""
    sigma: float = Field(1.0, ge=0.0, le=5.0)
    """Standard deviation of log(latency) in the body (1.0: p99 ~10x the median)."""
    tail_prob: float = Field(0.05, ge=0.0, le=1.0)
    """Share of episodes whose latency comes from the Pareto tail instead of the body."""
    tail_min_s: float = Field(2.0, gt=0.0, le=3600.0)
    """Smallest tail latency (the Pareto scale), in seconds."""
    tail_alpha: float = Field(1.5, gt=0.0, le=100.0)
    """Pareto shape: smaller is heavier; at or below 2 the tail has infinite variance."""
    max_s: float = Field(30.0, gt=0.0, le=3600.0)
    """Cap on any one latency (keep it below loop.episode_timeout_s)."""
    when: Literal["before", "after"] = "after"
    """Wait before the episode (sandbox start-up: its tokens are sampled late) or after it (a tool or
    verifier run on the answer: its tokens are sampled first and wait, so they can go stale)."""
    seed: int = 0
    """Seed of the latency draws; the n-th episode started gets the n-th draw."""


class LatencyDistribution:
    """Seeded draws from the configured lognormal-plus-Pareto mixture, in seconds."""

    def __init__(self, config: LatencyConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)

    def sample(self) -> float:
        c, rng = self.config, self.rng
        if rng.random() < c.tail_prob:
            latency = c.tail_min_s * rng.paretovariate(c.tail_alpha)
        else:
            latency = rng.lognormvariate(math.log(c.median_s), c.sigma)
        return min(latency, c.max_s)


class LatencyEnv:
    """`env` with a latency from `LatencyDistribution` added to every episode (train and eval alike)."""

    def __init__(self, env: Environment, config: LatencyConfig) -> None:
        self.env, self.config = env, config
        self.name = env.name
        self.latency = LatencyDistribution(config)
        # The runner opens a sandbox per episode for the wrapper exactly when the wrapped env needs one.
        self.needs_sandbox = needs_sandbox(env)

    def sample_task(self, rng: random.Random, split: Split = "train") -> Any:
        return self.env.sample_task(rng, split)

    async def run_episode(self, task: Any, client: Any, sandbox: Any = None) -> EpisodeResult:
        # Drawn when the episode starts, so the draws follow admission order whatever the finish order.
        latency = self.latency.sample()
        if self.config.when == "before":
            await asyncio.sleep(latency)
        if needs_sandbox(self.env):
            result = await self.env.run_episode(task, client, sandbox)
        else:  # environments without tools may not take a sandbox parameter at all (envs/base.py)
            result = await self.env.run_episode(task, client)
        if self.config.when == "after":
            await asyncio.sleep(latency)
        result.metrics = {**result.metrics, "tool_latency_s": latency}
        return result
