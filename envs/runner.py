"""Run one episode through the gateway's rollout lifecycle, and account for every way it can end.

open a rollout -> hand the environment a client bound to it -> finish with the reward and status.
Once the rollout is open, whatever the environment does (raise, hang, return garbage) the rollout
ends in exactly one recorded status and the runner does not raise, so one broken episode cannot take
a run down. Only a gateway that cannot open a rollout at all is an error for the caller.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import openai

from asyncrl.gateway.client import AsyncGatewayClient, GatewayRefused

from .base import EpisodeResult, Environment

log = logging.getLogger(__name__)


async def run_recorded_episode(
    env: Environment,
    task: Any,
    gateway: AsyncGatewayClient,
    *,
    group_id: str = "",
    metadata: dict | None = None,
    timeout_s: float = 300.0,
    http_client: Any = None,
) -> tuple[str, EpisodeResult]:
    """(rollout id, result) of one episode; the rollout is finished (or aborted) before returning.

    `http_client`: an `httpx.AsyncClient` shared by many episodes' OpenAI clients. Without one each
    episode builds its own (with its own SSL context: ~10 ms of CPU, most of a short episode's cost).
    """
    rollout = await gateway.open_rollout(task=env.name, group_id=group_id, metadata=metadata)
    shared = {"http_client": http_client} if http_client is not None else {}
    client = rollout.async_openai(max_retries=0, timeout=timeout_s, **shared)
    try:
        result = await asyncio.wait_for(env.run_episode(task, client), timeout_s)
        if not isinstance(result, EpisodeResult):
            result = EpisodeResult(0.0, "env_crash", reason=f"run_episode returned {type(result).__name__}, not EpisodeResult")
    except asyncio.TimeoutError:
        result = EpisodeResult(0.0, "timeout", reason=f"episode exceeded {timeout_s} s")
    except asyncio.CancelledError:
        await _abort(gateway, rollout.rollout_id, "cancelled")
        raise
    except openai.APIError as error:
        # The policy call failed (engine gone, limits): not the environment's fault.
        result = EpisodeResult(0.0, "error", reason=f"{type(error).__name__}: {error}")
    except Exception as error:  # the environment's own bug or its sandbox failing
        log.warning("environment %s crashed: %s", env.name, error)
        result = EpisodeResult(0.0, "env_crash", reason=f"{type(error).__name__}: {error}")
    finally:
        if http_client is None:
            await client.close()  # a shared client belongs to the caller
    try:
        await gateway.finish(rollout.rollout_id, result.reward, result.status, result.metrics, result.reason)
    except GatewayRefused as refusal:  # e.g. aborted meanwhile by the scheduler: already accounted for
        log.warning("rollout %s not finished: %s", rollout.rollout_id, refusal)
    return rollout.rollout_id, result


async def _abort(gateway: AsyncGatewayClient, rollout_id: str, reason: str) -> None:
    try:
        await gateway.abort(rollout_id, reason)
    except Exception:  # the gateway may be gone too; the store still holds the rollout as running
        log.warning("could not abort rollout %s", rollout_id)
