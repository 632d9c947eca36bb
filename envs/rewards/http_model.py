"""A reward-model service over HTTP: POST the episode as JSON, read the score back.

Request:  {"prompt_messages": [...], "completion": "...", "task": <the task as JSON>}
Response: {"reward": <finite number>, "details": {...}}   (details optional)

Anything else ends the episode as env_crash with a reason that says what happened: no answer within
`timeout_s`, a connection refused, a non-2xx status (with the start of the body), a body that is not
JSON or lacks a finite `reward`. The service is never retried here: a slow service answers slower
still under retries, and the learner drops a crashed episode at no cost to the others.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import httpx

from asyncrl.configs.context import EnvContext
from asyncrl.configs.schema import HTTPRewardConfig

from .base import PerLoop, RewardError, RewardResult


class HTTPReward:
    def __init__(self, config: HTTPRewardConfig | None = None) -> None:
        self.config = config or HTTPRewardConfig()
        self._client: PerLoop[httpx.AsyncClient] = PerLoop(lambda: httpx.AsyncClient(timeout=self.config.timeout_s))

    @classmethod
    def from_config(cls, context: EnvContext, **options: Any) -> HTTPReward:
        """`rewards.http` with `options` overriding its fields."""
        return cls(HTTPRewardConfig(**{**context.rewards.http.model_dump(), **options}))

    async def score(self, prompt_messages: list[dict], completion_text: str, task: Any) -> RewardResult:
        url = self.config.url
        payload = {"prompt_messages": prompt_messages, "completion": completion_text, "task": task_json(task)}
        try:
            response = await self._client.get().post(url, json=payload)
        except httpx.TimeoutException as error:
            raise RewardError(f"reward service {url} gave no answer within {self.config.timeout_s} s ({type(error).__name__})") from error
        except httpx.HTTPError as error:
            raise RewardError(f"reward service {url} unreachable: {type(error).__name__}: {error}") from error
        if not response.is_success:
            raise RewardError(f"reward service {url} answered {response.status_code}: {response.text[:200]!r}")
        try:
            body = response.json()
        except ValueError as error:
            raise RewardError(f"reward service {url} answered non-JSON: {response.text[:200]!r}") from error
        reward = body.get("reward") if isinstance(body, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise RewardError(f"reward service {url} answered without a finite 'reward': {response.text[:200]!r}")
        details = body.get("details") or {}
        return RewardResult(float(reward), details if isinstance(details, dict) else {"details": details})


def task_json(task: Any) -> Any:
    """The task as JSON for a service: a dataclass as its fields, JSON values as they are, else its repr."""
    if dataclasses.is_dataclass(task) and not isinstance(task, type):
        return dataclasses.asdict(task)
    try:
        json.dumps(task)
    except (TypeError, ValueError):
        return repr(task)
    return task
