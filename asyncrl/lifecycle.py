"""The rollout lifecycle as whoever runs episodes sees it: open a rollout, finish it, or abort it.

Episode runners (envs/runner.py, envs/evaluation.py) depend on this small Protocol, not on the
gateway: the gateway's HTTP clients (`gateway/client.py`) and its in-process lifecycle
(`gateway/lifecycle.py`) implement it. A rollout opened with `evaluation=True` is played greedily
(or, with `sampled=True`, as its calls ask) and recorded nowhere (held-out evaluation); any other is
recorded for the learner.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol


class LifecycleRefused(RuntimeError):
    """The gateway refused a lifecycle call; `status` is the HTTP status it answered (or would have)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"gateway refused ({status}): {message}")
        self.status, self.message = status, message


class Rollout(NamedTuple):
    rollout_id: str
    api_key: str
    base_url: str
    """The OpenAI base URL (`.../v1`) to hand to the agent with `api_key`."""

    def openai(self, **kwargs: Any):
        """An `openai.OpenAI` client bound to this rollout."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def async_openai(self, **kwargs: Any):
        """An `openai.AsyncOpenAI` client bound to this rollout (`asyncrl.episode_client.EpisodeClient`)."""
        from .episode_client import EpisodeClient

        return EpisodeClient(base_url=self.base_url, api_key=self.api_key, **kwargs)


class RolloutLifecycle(Protocol):
    """Refusals raise `LifecycleRefused`."""

    async def open_rollout(
        self, task: str = "", group_id: str = "", metadata: dict | None = None, *, evaluation: bool = False, sampled: bool = False
    ) -> Rollout:
        """`evaluation`: greedy and recorded nowhere; with `sampled` too, sampled as its calls ask (pass@k)."""
        ...

    async def finish(self, rollout_id: str, reward: float, status: str = "ok", metrics: dict | None = None, reason: str = "") -> Any:
        """End the rollout with its reward. What it returns is the implementation's (the HTTP client: the
        rollout's info; the in-process lifecycle: nothing); episode runners do not read it."""
        ...

    async def abort(self, rollout_id: str, reason: str = "") -> Any: ...
