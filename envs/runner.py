"""Run one episode through the gateway's rollout lifecycle, and account for every way it can end.

open a rollout -> (open a sandbox) -> hand the environment a client bound to the rollout -> close the
sandbox -> finish with the reward and status. Once the rollout is open, whatever the environment or
its sandbox does (raise, hang, return garbage, fail to start) the rollout ends in exactly one
recorded status and the runner does not raise, so one broken episode cannot take a run down. Only a
gateway that cannot open a rollout at all is an error for the caller.

The gateway is reached through the `asyncrl.lifecycle.RolloutLifecycle` Protocol (its HTTP client or
its in-process lifecycle), and the policy through the real OpenAI client. Held-out evaluation plays
its episodes this same way, in rollouts opened for evaluation (envs/evaluation.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

import openai

from asyncrl.lifecycle import LifecycleRefused, RolloutLifecycle

from .base import Environment, EpisodeResult, needs_sandbox

log = logging.getLogger(__name__)


async def run_recorded_episode(
    env: Environment,
    task: Any,
    gateway: RolloutLifecycle,
    *,
    group_id: str = "",
    metadata: dict | None = None,
    timeout_s: float = 300.0,
    http_client: Any = None,
    sandboxes: Any = None,
    task_name: str | None = None,
    evaluation: bool = False,
    sampled: bool = False,
) -> tuple[str, EpisodeResult]:
    """(rollout id, result) of one episode; the rollout is finished (or aborted) before returning.

    `http_client`: an HTTP client the OpenAI client accepts, shared by many episodes. Without one each
    episode builds its own (with its own SSL context: ~10 ms of CPU, most of a short episode's cost).
    `sandboxes`: the `SandboxBackend` that opens a sandbox per episode for environments that need one.
    `task_name`: recorded as the rollout's task (default: the environment's name).
    `evaluation`: play it in an evaluation rollout (greedy, recorded nowhere) instead; `sampled`: one
    that samples as the environment asks (pass@k).
    """
    rollout = await _open(gateway, task=task_name or env.name, group_id=group_id, metadata=metadata, evaluation=evaluation, sampled=sampled)
    shared = {"http_client": http_client} if http_client is not None else {}
    client = rollout.async_openai(max_retries=0, timeout=timeout_s, **shared)
    try:
        result = await play_episode(env, task, client, sandboxes, timeout_s)
    except asyncio.CancelledError:
        await _abort(gateway, rollout.rollout_id, "cancelled")
        raise
    finally:
        if http_client is None:
            await client.close()  # a shared client belongs to the caller
    try:
        await gateway.finish(rollout.rollout_id, result.reward, result.status, result.metrics, result.reason)
    except LifecycleRefused as refusal:  # e.g. aborted meanwhile by the scheduler: already accounted for
        log.warning("rollout %s not finished: %s", rollout.rollout_id, refusal)
    return rollout.rollout_id, result


async def play_episode(env: Environment, task: Any, client: Any, sandboxes: Any = None, timeout_s: float = 300.0) -> EpisodeResult:
    """One episode against any OpenAI-compatible `client`, every failure turned into a status.

    The sandbox (when the environment needs one) is opened inside the time limit, so a sandbox that
    cannot start ends the episode as env_crash or timeout, and it is closed whatever happened.
    Only cancellation propagates.
    """
    try:
        return await _within(timeout_s, _play(env, task, client, sandboxes))
    except asyncio.TimeoutError:
        return EpisodeResult(0.0, "timeout", reason=f"episode exceeded {timeout_s} s")
    except openai.APIError as error:
        # The policy call failed (engine gone, limits): not the environment's fault.
        return EpisodeResult(0.0, "error", reason=f"{type(error).__name__}: {error}")
    except Exception as error:  # the environment's own bug, or its sandbox failing (SandboxError)
        log.warning("environment %s crashed: %s", env.name, error)
        return EpisodeResult(0.0, "env_crash", reason=f"{type(error).__name__}: {error}")


async def _within(timeout_s: float, episode: Awaitable[EpisodeResult]) -> EpisodeResult:
    """`episode`, or TimeoutError after `timeout_s`. `asyncio.timeout` where there is one (Python 3.11):
    `wait_for` there runs the episode on a task of its own, one more task for every episode."""
    if not hasattr(asyncio, "timeout"):
        return await asyncio.wait_for(episode, timeout_s)
    async with asyncio.timeout(timeout_s):
        return await episode


async def _play(env: Environment, task: Any, client: Any, sandboxes: Any) -> EpisodeResult:
    if not needs_sandbox(env):
        result = await env.run_episode(task, client)
    else:
        if sandboxes is None:
            raise RuntimeError(f"environment {env.name} needs a sandbox and no sandbox backend was given")
        sandbox = await sandboxes.open()
        try:
            result = await env.run_episode(task, client, sandbox)
        finally:
            await _close(sandbox, env.name)
    if not isinstance(result, EpisodeResult):
        return EpisodeResult(0.0, "env_crash", reason=f"run_episode returned {type(result).__name__}, not EpisodeResult")
    return result


async def _close(sandbox: Any, env_name: str) -> None:
    # Shielded: a timeout or cancellation of the episode must not leave the sandbox running.
    try:
        await asyncio.shield(sandbox.close())
    except asyncio.CancelledError:
        raise
    except Exception as error:  # the episode's result stands; the backend owns cleaning up after itself
        log.warning("closing the sandbox of a %s episode failed: %s", env_name, error)


async def _open(gateway: RolloutLifecycle, **request: Any) -> Any:
    """Open the rollout, shielded: a cancellation that lands while the gateway is opening it (the store
    write runs in a thread and completes anyway) still aborts the rollout, instead of leaving it running
    with no episode to end it."""
    opening = asyncio.ensure_future(gateway.open_rollout(**request))
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        try:
            rollout = await opening
        except Exception:  # never opened: nothing to abort
            raise asyncio.CancelledError from None
        await _abort(gateway, rollout.rollout_id, "cancelled")
        raise


async def _abort(gateway: RolloutLifecycle, rollout_id: str, reason: str) -> None:
    try:
        await gateway.abort(rollout_id, reason)
    except Exception:  # the gateway may be gone too; the store still holds the rollout as running
        log.warning("could not abort rollout %s", rollout_id)
