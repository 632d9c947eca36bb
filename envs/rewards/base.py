"""The reward contract: `await reward.score(prompt_messages, completion_text, task) -> RewardResult`.

A reward that cannot give a score (its service is down, slow, or answers something unreadable)
raises `RewardError`. The episode runner ends such an episode as `env_crash`, which the learner
drops: a missing score is not a zero score, and training on it would teach the policy the service's
failures. `RewardError` is deliberately not an `openai.APIError`, which the runner reads as the
*policy's* call failing (status `error`), so rewards that use the openai client must wrap its errors.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable


@dataclass
class RewardResult:
    reward: float
    details: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable explanation (which rules failed, the judge's verdict), stored with the trajectory."""


class RewardError(RuntimeError):
    """The reward could not be computed; the episode ends as env_crash with this message as its reason."""


@runtime_checkable
class Reward(Protocol):
    async def score(self, prompt_messages: list[dict], completion_text: str, task: Any) -> RewardResult:
        """Score `completion_text`, the policy's answer to `prompt_messages` (OpenAI-style messages) for `task`."""
        ...


Client = TypeVar("Client")


class PerLoop(Generic[Client]):
    """One async HTTP client per event loop: pooled connections belong to the loop that opened them,
    and an environment may be scored from several loops (training, then evaluation in tests)."""

    def __init__(self, factory: Callable[[], Client]) -> None:
        self._factory = factory
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Client] = weakref.WeakKeyDictionary()

    def get(self) -> Client:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = self._factory()
        return client
