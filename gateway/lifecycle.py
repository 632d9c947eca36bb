"""The rollout lifecycle (open, finish, abort) called on the in-process gateway directly.

The episode runner opens and finishes rollouts through a lifecycle client; `asyncrl run` hosts the
gateway in its own process, so those calls need no HTTP: they call the service's lifecycle directly.
It needs no run token: it holds the service itself, which only code in the gateway's own process
can. The policy calls go through the OpenAI API, as any agent's would, over an HTTP client that
`episode_http_client(config, lifecycle)` (gateway/serving.py) points at `app` without a socket.
Same verbs and refusals as `AsyncGatewayClient`: both implement `asyncrl.lifecycle.RolloutLifecycle`.
"""

from __future__ import annotations

from typing import Any

from asyncrl.gateway import api
from asyncrl.gateway.errors import GatewayError
from asyncrl.gateway.service import GatewayService
from asyncrl.gateway.store import RolloutClosed, StoreError, UnknownRollout
from asyncrl.lifecycle import LifecycleRefused, Rollout


class InProcessLifecycle:
    def __init__(self, service: GatewayService, url: str, *, app: Any = None) -> None:
        self.service, self.url = service, url.rstrip("/")
        self.app = app
        """The gateway's ASGI app, where this process serves it (for `InProcessTransport`), else None."""

    async def open_rollout(
        self, task: str = "", group_id: str = "", metadata: dict | None = None, *, evaluation: bool = False, sampled: bool = False
    ) -> Rollout:
        request = api.OpenRolloutRequest(task=task, group_id=group_id, metadata=metadata or {}, evaluation=evaluation, sampled=sampled)
        opened = await _refusing(self.service.rollouts.open(request))
        return Rollout(opened.rollout_id, opened.api_key, opened.base_url or self.url + "/v1")

    async def finish(self, rollout_id: str, reward: float, status: str = "ok", metrics: dict | None = None, reason: str = "") -> None:
        # Returns nothing: the HTTP route's answer (the rollout's info) is one more store read, the whole
        # trajectory parsed, per episode, and no episode runner reads it.
        request = api.FinishRolloutRequest(reward=reward, status=status, metrics=metrics or {}, reason=reason)
        await _refusing(self.service.rollouts.settle(rollout_id, request))

    async def abort(self, rollout_id: str, reason: str = ""):
        return await _refusing(self.service.rollouts.abort(rollout_id, api.AbortRolloutRequest(reason=reason)))


async def _refusing(call):
    """The HTTP client's error contract: a refusal is a LifecycleRefused with the status it would get."""
    try:
        return await call
    except UnknownRollout as error:
        raise LifecycleRefused(404, str(error)) from None
    except RolloutClosed as error:
        raise LifecycleRefused(409, str(error)) from None
    except StoreError as error:
        raise LifecycleRefused(400, str(error)) from None
    except GatewayError as error:
        raise LifecycleRefused(error.status, str(error)) from None
