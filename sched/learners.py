"""The learner client (`sched/parts.py` LearnerClient), over a Ray actor or in this process.

`RayLearner` wraps the LearnerActor `asyncrl run` starts: its weights leave it as one ObjectRef that
every rollout worker reads, so they never pass through the driver (or, with a direct transport, the
learner sends them itself: `sched/weight_push.py`). A call that finds the actor dead raises
`LearnerDied`, and `restart` starts a new one from a checkpoint. `LocalLearner` holds an `RLLearner` in
this process and steps it on a thread, so episodes run on meanwhile as they do beside the actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncrl.records import Batch, StepResult

from .parts import LearnerDied, Weights
from .ray_calls import creation_failure, died, remote
from .weight_push import DirectPush

if TYPE_CHECKING:
    from asyncrl.learner.rl import RLLearner


class RayLearner:
    def __init__(self, start: Callable[[str | None], Any], checkpoint: str | None = None) -> None:
        """`start(checkpoint)` starts a LearnerActor (`learner/actor.py`) from a checkpoint directory or None."""
        self.start = start
        self.actor = start(checkpoint)
        self.direct: tuple[str, str | None] | None = None
        """Set when the learner pushes its weights itself (`sched/weight_push.py`): transport and backend."""

    async def train_step(self, batch: Batch) -> StepResult:
        return await self._call(self.actor.train_step, batch)

    async def weights(self) -> Weights:
        if self.direct is not None:
            return DirectPush(self.actor, *self.direct)
        return self.actor.state.remote()  # the ObjectRef: the workers fetch the weights, not the driver

    async def save(self, directory: str) -> None:
        await self._call(self.actor.save, directory)

    async def check(self) -> None:
        await self._call(self.actor.version)

    async def usage(self) -> dict:
        return await self._call(self.actor.usage)

    async def reads(self, path: str, token: str) -> list[str]:
        """The learner ranks, with their nodes, that do not read `token` from the file `path` (`asyncrl/jobs/cluster.py`)."""
        return await self._call(self.actor.reads, path, token)

    async def restart(self, checkpoint: str | None) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.actor)  # dead already; a half-alive one must not train beside its replacement
        self.actor = self.start(checkpoint)
        await self.check()  # up, with the checkpoint loaded

    async def _call(self, method, *args):
        import ray

        try:
            return await remote(method, *args)
        except ray.exceptions.RayActorError as error:
            if not died(error, self.actor):
                raise
            raise LearnerDied(f"the learner actor died: {type(error).__name__}{creation_failure(error)}") from error


class LocalLearner:
    def __init__(self, learner: RLLearner) -> None:
        self.learner = learner

    async def train_step(self, batch: Batch) -> StepResult:
        return await asyncio.to_thread(self.learner.train_step, batch)

    async def weights(self) -> Weights:
        return await asyncio.to_thread(self.learner.state_dict_for_push)

    async def save(self, directory: str) -> None:
        await asyncio.to_thread(self.learner.save, directory)

    async def check(self) -> None:
        return None  # it lives and dies with this process

    async def usage(self) -> dict:
        return {"process_cpu_s": time.process_time()}  # this process's: the driver's too

    async def restart(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            raise RuntimeError("an in-process learner restarts from a checkpoint only")
        await asyncio.to_thread(self.learner.load, checkpoint)
