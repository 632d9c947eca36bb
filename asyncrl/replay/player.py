"""Re-play recorded episodes: the run's own environments, the same gateway code, the recorded completions.

For each recorded rollout the player builds its task's environment from the run's config as the run
did (`TaskMix.from_config`: the task by name, its options, its sandbox backend), draws the problem
from the rollout's `task_seed` (`env.sample_task(random.Random(task_seed), "train")`, as the loop's
admission does) and plays the episode through `run_recorded_episode` against an `InProcessGateway`
whose only engine is a `ReplayEngine`. The gateway records the replay into a scratch store in a
temporary directory, deleted afterwards; the run's own store is only read.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.configs.schema import RunConfig
from asyncrl.envs.base import EpisodeResult
from asyncrl.envs.runner import run_recorded_episode
from asyncrl.lifecycle import Rollout, RolloutLifecycle
from asyncrl.records import Trajectory
from asyncrl.sched.tasks import Task, TaskMix

from .engine import ReplayEngine, Script

REPLAY_OF = "replay_of"
"""Metadata key of a replaying rollout: the id of the recorded rollout it replays."""
UNFINISHED = ("running", "aborted")


@dataclass
class Replayed:
    """One recorded rollout and what its replay did."""

    recorded: Trajectory
    script: Script
    """The prompts the gateway built for each call, in order."""
    replay: Trajectory
    """The replay as the gateway recorded it (scratch store): its turns, reward, status and metrics."""
    result: EpisodeResult


class Player:
    """Replays trajectories of the run `config` describes; `async with Player(config) as player`."""

    def __init__(self, config: RunConfig, tokenizer: Any = None) -> None:
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config)
        self.mix = TaskMix.from_config(config)
        self.tasks: dict[str, Task] = {task.name: task for task in self.mix.tasks}

    def unreplayable(self, trajectory: Trajectory) -> str | None:
        """Why `trajectory` cannot be replayed, or None when it can."""
        if "task_seed" not in trajectory.metadata:
            return (
                "it records no task_seed (the seed its problem was drawn from): it was recorded before runs kept one, "
                "or by a client that is not the loop (asyncrl serve), so its problem cannot be drawn again"
            )
        if trajectory.task not in self.tasks:
            return f"its task {trajectory.task!r} is not in the run's config (tasks.mix has {', '.join(sorted(self.tasks)) or 'none'})"
        if trajectory.status in UNFINISHED:
            return f"it is {trajectory.status}: its episode never finished, so there is no outcome to compare"
        if trajectory.status == "timeout":
            return "it timed out, which depends on how fast the policy answered; a replay answers at once"
        return None

    async def play(
        self, trajectories: list[Trajectory], *, concurrency: int = 8, on_done: Callable[[Replayed], None] | None = None
    ) -> list[Replayed]:
        """Replay each trajectory (all must be replayable), `concurrency` at a time; results in the same order."""
        from asyncrl.gateway.engines import LocalEngine
        from asyncrl.gateway.serving import InProcessGateway, episode_http_client
        from asyncrl.gateway.store import open_store

        for trajectory in trajectories:
            if (why := self.unreplayable(trajectory)) is not None:
                raise ValueError(f"rollout {trajectory.rollout_id} cannot be replayed: {why}")
        if any(self.tasks[t.task].sandboxes is not None for t in trajectories):
            await self.mix.check_sandboxes()
        engine = ReplayEngine()
        served = self.config.model_copy(update={"gateway": self.config.gateway.model_copy(update={"port": 0})})
        limit = asyncio.Semaphore(concurrency)
        with tempfile.TemporaryDirectory(prefix="asyncrl-replay-") as directory:
            store = open_store(directory)
            try:
                async with (
                    InProcessGateway(served, store, [LocalEngine(engine)], self.tokenizer) as gateway,
                    episode_http_client(served, gateway) as http,
                ):
                    binding = _Binding(gateway, engine, {t.rollout_id: t for t in trajectories})

                    async def one(recorded: Trajectory) -> Replayed:
                        async with limit:
                            replayed = await self._play_one(recorded, binding, http, store)
                        if on_done is not None:
                            on_done(replayed)
                        return replayed

                    return list(await asyncio.gather(*(one(t) for t in trajectories)))
            finally:
                store.close()

    async def _play_one(self, recorded: Trajectory, binding: _Binding, http: Any, store: Any) -> Replayed:
        task = self.tasks[recorded.task]
        problem = task.env.sample_task(random.Random(recorded.metadata["task_seed"]), "train")
        rollout_id, result = await run_recorded_episode(
            task.env, problem, binding, group_id=recorded.group_id, metadata={**recorded.metadata, REPLAY_OF: recorded.rollout_id},
            timeout_s=self.config.loop.episode_timeout_s, http_client=http, sandboxes=task.sandboxes, task_name=recorded.task,
        )  # fmt: skip
        replay = await asyncio.to_thread(store.get, rollout_id)
        return Replayed(recorded, binding.engine.scripts[rollout_id], replay, result)


class _Binding:
    """The gateway's lifecycle, binding each rollout it opens to the recorded one it replays (before the
    episode's first call), so the replay engine knows which record answers that session."""

    def __init__(self, inner: RolloutLifecycle, engine: ReplayEngine, recorded: dict[str, Trajectory]) -> None:
        self.inner, self.engine, self.recorded = inner, engine, recorded

    async def open_rollout(
        self, task: str = "", group_id: str = "", metadata: dict | None = None, *, evaluation: bool = False, sampled: bool = False
    ) -> Rollout:
        rollout = await self.inner.open_rollout(task, group_id, metadata, evaluation=evaluation, sampled=sampled)
        self.engine.expect(rollout.rollout_id, self.recorded[(metadata or {})[REPLAY_OF]])
        return rollout

    async def finish(self, rollout_id: str, reward: float, status: str = "ok", metrics: dict | None = None, reason: str = "") -> Any:
        return await self.inner.finish(rollout_id, reward, status, metrics, reason)

    async def abort(self, rollout_id: str, reason: str = "") -> Any:
        return await self.inner.abort(rollout_id, reason)


def load_tokenizer(config: RunConfig) -> Any:
    """The run's tokenizer: the one saved with `policy.path`, else the embedded character-level one."""
    if config.policy.path is None:
        from asyncrl.policy.tokenizer import build_tokenizer

        return build_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.policy.path)
