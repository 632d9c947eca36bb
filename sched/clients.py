"""The learner and worker-group clients (`sched/parts.py`), over Ray actors or in this process.

`RayLearner` and `RayWorkers` wrap the LearnerActor and RolloutWorker handles `asyncrl run` starts:
the weights leave the learner as one ObjectRef that every worker reads (`learner/publish.py`), so
they never pass through the driver. `LocalLearner` and `LocalWorkers` hold an `RLLearner` and
`EmbeddedEngine`s in this process: the learner steps on a thread, so episodes run on meanwhile as
they do beside the actors, and the loop is the same loop without Ray.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from asyncrl.gateway.engines import EngineHandle, LocalEngine, RayEngine
from asyncrl.records import Sample

from .parts import Weights

if TYPE_CHECKING:
    from asyncrl.learner.rl import RLLearner
    from asyncrl.rollout.engine import EmbeddedEngine


class RayLearner:
    def __init__(self, actor: Any) -> None:
        self.actor = actor
        """The LearnerActor handle (`learner/actor.py`)."""

    async def train_step(self, samples: list[Sample]) -> dict:
        return await asyncio.wrap_future(self.actor.train_step.remote(samples).future())

    async def weights(self) -> Weights:
        return self.actor.state.remote()  # the ObjectRef: the workers fetch the weights, not the driver

    async def save(self, directory: str) -> None:
        await self.actor.save.remote(directory)


class RayWorkers:
    def __init__(self, workers: list, name_prefix: str) -> None:
        """`workers`: RolloutWorker handles, each engine named `<name_prefix>-<i>` (as `create_workers` names them)."""
        self.actors = workers
        self.engines: list[EngineHandle] = [RayEngine(worker, f"{name_prefix}-{i}") for i, worker in enumerate(workers)]

    async def update_weights(self, weights: Weights, version: int) -> list[int]:
        from asyncrl.learner.publish import push_weights

        return await asyncio.to_thread(push_weights, self.actors, weights, version)

    async def versions(self) -> list[int]:
        return list(await asyncio.gather(*(worker.version.remote() for worker in self.actors)))

    async def health(self) -> list[dict]:
        return list(await asyncio.gather(*(worker.health.remote() for worker in self.actors)))


class LocalLearner:
    def __init__(self, learner: RLLearner) -> None:
        self.learner = learner

    async def train_step(self, samples: list[Sample]) -> dict:
        return await asyncio.to_thread(self.learner.train_step, samples)

    async def weights(self) -> Weights:
        return await asyncio.to_thread(self.learner.state_dict_for_push)

    async def save(self, directory: str) -> None:
        await asyncio.to_thread(self.learner.save, directory)


class LocalWorkers:
    def __init__(self, engines: list[EmbeddedEngine]) -> None:
        self.local = engines
        self.engines: list[EngineHandle] = [LocalEngine(engine) for engine in engines]

    async def update_weights(self, weights: Weights, version: int) -> list[int]:
        # Each swap blocks until its engine's stepping thread takes it; the event loop serves on.
        await asyncio.gather(*(asyncio.to_thread(engine.update_weights, weights, version) for engine in self.local))
        versions = await self.versions()
        if any(v != version for v in versions):
            raise RuntimeError(f"pushed version {version} but engines report {versions}")
        return versions

    async def versions(self) -> list[int]:
        return [engine.version for engine in self.local]

    async def health(self) -> list[dict]:
        return [engine.health() for engine in self.local]
