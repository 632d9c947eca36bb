"""The episodes a run has in flight: asyncio tasks on the loop's event loop, one rollout each.

Each episode is the environment's own `run_episode` played through the gateway's rollout lifecycle
(`envs/runner.py`), which ends its rollout in exactly one recorded status whatever the environment
does; only a gateway that refuses to open a rollout fails an episode, and `check` raises that.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from asyncrl.envs.runner import run_recorded_episode

from .tasks import Task

if TYPE_CHECKING:
    from openai import DefaultAioHttpClient

    from asyncrl.lifecycle import RolloutLifecycle


class Episodes:
    def __init__(self, gateway: RolloutLifecycle, http_client: DefaultAioHttpClient, timeout_s: float) -> None:
        self.gateway, self.http_client, self.timeout_s = gateway, http_client, timeout_s
        self.running: set[asyncio.Task] = set()
        self.failures: list[BaseException] = []

    def __len__(self) -> int:
        return len(self.running)

    def check(self) -> None:
        """Raise why an episode could not start, if one could not."""
        if self.failures:
            raise RuntimeError(f"an episode could not start: {self.failures[0]!r}") from self.failures[0]

    def start_group(
        self, task: Task, problem: Any, group_id: str, size: int, admitted_at_version: int, task_seed: int | None = None
    ) -> None:
        """`size` episodes of `problem`, one GRPO group. `task_seed`: the seed `problem` was drawn with
        (`env.sample_task(random.Random(task_seed), "train")`), recorded in each rollout's metadata."""
        metadata: dict[str, Any] = {"admitted_at_version": admitted_at_version}
        if task_seed is not None:
            metadata["task_seed"] = task_seed
        for _ in range(size):
            episode = run_recorded_episode(
                task.env, problem, self.gateway, group_id=group_id, timeout_s=self.timeout_s,
                metadata=dict(metadata), http_client=self.http_client,
                sandboxes=task.sandboxes, task_name=task.name,
            )  # fmt: skip
            running = asyncio.create_task(episode)
            self.running.add(running)
            running.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.running.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self.failures.append(error)  # the gateway refused to open a rollout

    async def stop(self) -> None:
        """Cancel every episode still running and wait for them (the runner aborts each one's rollout)."""
        running = list(self.running)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
