"""A small client for the rollout lifecycle, for whoever runs episodes (an env runner, a script).

    with GatewayClient("http://127.0.0.1:8000") as gateway:
        rollout_id, api_key, base_url = gateway.open_rollout(task="arith", group_id="g7")
        agent = openai.OpenAI(base_url=base_url, api_key=api_key)   # an unmodified agent
        ...
        gateway.finish(rollout_id, reward=1.0)

`AsyncGatewayClient` has the same verbs for asyncio code. Refusals raise `GatewayRefused` with the
gateway's status and message.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import httpx


class GatewayRefused(RuntimeError):
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
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


def _body(response: httpx.Response) -> dict:
    if response.is_success:
        return response.json()
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    raise GatewayRefused(response.status_code, message)


def _open_body(task: str, group_id: str, metadata: dict | None) -> dict:
    return {"task": task, "group_id": group_id, "metadata": metadata or {}}


def _finish_body(reward: float, status: str, metrics: dict | None, reason: str) -> dict:
    return {"reward": reward, "status": status, "metrics": metrics or {}, "reason": reason}


class GatewayClient:
    def __init__(self, url: str, *, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout)

    def open_rollout(self, task: str = "", group_id: str = "", metadata: dict | None = None) -> Rollout:
        data = _body(self._http.post("/rollouts", json=_open_body(task, group_id, metadata)))
        return Rollout(data["rollout_id"], data["api_key"], self.url + "/v1")

    def finish(self, rollout_id: str, reward: float, status: str = "ok", metrics: dict | None = None, reason: str = "") -> dict:
        return _body(self._http.post(f"/rollouts/{rollout_id}/finish", json=_finish_body(reward, status, metrics, reason)))

    def abort(self, rollout_id: str, reason: str = "") -> dict:
        return _body(self._http.post(f"/rollouts/{rollout_id}/abort", json={"reason": reason}))

    def get(self, rollout_id: str) -> dict:
        return _body(self._http.get(f"/rollouts/{rollout_id}"))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "GatewayClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncGatewayClient:
    def __init__(self, url: str, *, timeout: float = 30.0, **httpx_options: Any) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout, **httpx_options)

    async def open_rollout(self, task: str = "", group_id: str = "", metadata: dict | None = None) -> Rollout:
        data = _body(await self._http.post("/rollouts", json=_open_body(task, group_id, metadata)))
        return Rollout(data["rollout_id"], data["api_key"], self.url + "/v1")

    async def finish(self, rollout_id: str, reward: float, status: str = "ok", metrics: dict | None = None, reason: str = "") -> dict:
        return _body(await self._http.post(f"/rollouts/{rollout_id}/finish", json=_finish_body(reward, status, metrics, reason)))

    async def abort(self, rollout_id: str, reason: str = "") -> dict:
        return _body(await self._http.post(f"/rollouts/{rollout_id}/abort", json={"reason": reason}))

    async def get(self, rollout_id: str) -> dict:
        return _body(await self._http.get(f"/rollouts/{rollout_id}"))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncGatewayClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
