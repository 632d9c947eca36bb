"""The environment contract: what an episode returns, and the small Protocol every environment meets.

An environment draws tasks and runs one episode of a task against an OpenAI-compatible client bound
to one rollout (the gateway records every call the client makes). It returns the reward and the
episode's status; it never needs to know about token IDs, the store or the learner.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

EpisodeStatus = Literal["ok", "env_crash", "timeout", "error"]
"""ok: the episode ran (whatever its reward); env_crash: the environment or its sandbox failed and the
learner drops the rollout; timeout: the episode ran out of time; error: the policy call failed."""

Split = Literal["train", "eval"]


@dataclass
class EpisodeResult:
    reward: float
    status: EpisodeStatus = "ok"
    metrics: dict[str, Any] = field(default_factory=dict)
    """Environment-specific numbers (e.g. turns, tool calls), stored with the trajectory."""
    reason: str = ""
    """Why the status is not ok, for people reading the trajectory."""


@runtime_checkable
class Environment(Protocol):
    name: str
    """Registry name; also the `task` recorded with each rollout."""

    def sample_task(self, rng: random.Random, split: Split = "train") -> Any:
        """One task from the training split, or from the held-out evaluation split."""
        ...

    async def run_episode(self, task: Any, client: Any) -> EpisodeResult:
        """Play one episode of `task`; `client` is an `openai.AsyncOpenAI` bound to this rollout."""
        ...
