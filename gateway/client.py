"""A small client for the rollout lifecycle, for whoever runs episodes (an env runner, a script).

    with GatewayClient("http://127.0.0.1:8000", token=run_token) as gateway:
        rollout_id, api_key, base_url = gateway.open_rollout(task="arith", group_id="g7")
        agent = openai.OpenAI(base_url=base_url, api_key=api_key)   # an unmodified agent
        ...
        gateway.finish(rollout_id, reward=1.0)

`AsyncGatewayClient` has the same verbs for asyncio code (it implements `asyncrl.lifecycle.RolloutLifecycle`).
`token` is the gateway's run token (`asyncrl token CONFIG` for an `asyncrl serve` run), sent on every
call; leave it out for a gateway with `gateway.auth: false`. The rollout key goes to the agent only.
Refusals raise `GatewayRefused` (the lifecycle's `LifecycleRefused`) with the gateway's status and message.
`open_rollout(..., evaluation=True)` opens an evaluation rollout: sampled greedily, recorded nowhere.
"""

from __future__ import annotations

from typing import Any

import httpx

from asyncrl.lifecycle import LifecycleRefused, Rollout

GatewayRefused = LifecycleRefused
"""The gateway's name for a refused lifecycle call."""

__all__ = ["AsyncGatewayClient", "GatewayClient", "GatewayRefused", "Rollout"]


def _body(response: httpx.Response) -> dict:
    if response.is_success:
        return response.json()
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    raise GatewayRefused(response.status_code, message)


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _open_body(task: str, group_id: str, metadata: dict | None, evaluation: bool, sampled: bool) -> dict:
    return {"task": task, "group_id": group_id, "metadata": metadata or {}, "evaluation": evaluation, "sampled": sampled}


def _finish_body(reward: float, status: str, metrics: dict | None, reason: str) -> dict:
    return {"reward": reward, "status": status, "metrics": metrics or {}, "reason": reason}


class GatewayClient:
    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=_headers(token))

    def open_rollout(
        self, task: str = "", group_id: str = "", metadata: dict | None = None, *, evaluation: bool = False, sampled: bool = False
    ) -> Rollout:
        data = _body(self._http.post("/rollouts", json=_open_body(task, group_id, metadata, evaluation, sampled)))
        return Rollout(data["rollout_id"], data["api_key"], data.get("base_url") or self.url + "/v1")

    def finish(self, rollout_id: str, reward: float, status: str = "ok", metrics: dict | None = None, reason: str = "") -> dict:
        return _body(self._http.post(f"/rollouts/{rollout_id}/finish", json=_finish_body(reward, status, metrics, reason)))

    def abort(self, rollout_id: str, reason: str = "") -> dict:
        return _body(self._http.post(f"/rollouts/{rollout_id}/abort", json={"reason": reason}))

    def get(self, rollout_id: str) -> dict:
        return _body(self._http.get(f"/rollouts/{rollout_id}"))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncGatewayClient:
    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0, client: Any = None, **httpx_options: Any) -> None:
        """`client`: an AsyncClient with httpx's interface to send through, sharing its pool (e.g. the aiohttp
        one of `openai.DefaultAioHttpClient`); it stays open after `aclose`. Default: a client of its own."""
        self.url = url.rstrip("/")
        self._headers = {**_headers(token), **httpx_options.pop("headers", {})}
        self._timeout = timeout
        self._owned = client is None
        self._http = client if client is not None else httpx.AsyncClient(timeout=timeout, **httpx_options)

    async def _post(self, path: str, body: dict) -> dict:
        return _body(await self._http.post(self.url + path, json=body, headers=self._headers, timeout=self._timeout))

    async def open_rollout(
        self, task: str = "", group_id: str = "", metadata: dict | None = None, *, evaluation: bool = False, sampled: bool = False
    ) -> Rollout:
        data = await self._post("/rollouts", _open_body(task, group_id, metadata, evaluation, sampled))
        return Rollout(data["rollout_id"], data["api_key"], data.get("base_url") or self.url + "/v1")

    async def finish(self, rollout_id: str, reward: float, status: str = "ok", metrics: dict | None = None, reason: str = "") -> dict:
        return await self._post(f"/rollouts/{rollout_id}/finish", _finish_body(reward, status, metrics, reason))

    async def abort(self, rollout_id: str, reason: str = "") -> dict:
        return await self._post(f"/rollouts/{rollout_id}/abort", {"reason": reason})

    async def get(self, rollout_id: str) -> dict:
        return _body(await self._http.get(f"{self.url}/rollouts/{rollout_id}", headers=self._headers, timeout=self._timeout))

    async def aclose(self) -> None:
        if self._owned:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncGatewayClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
