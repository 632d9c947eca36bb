"""The worker group (`sched/parts.py` WorkerGroup): the rollout engines a run serves from, and the push
of the learner's weights to all of them, over Ray actors or in this process.

`RayWorkers` holds the RolloutWorker actors `asyncrl run` starts. A push hands every member the same
weights (an ObjectRef the workers read from the object store; or, with a direct transport, the learner
sends them itself, `sched/weight_push.py`), under a lock, and remembers the last one, which is what a
replacement for a dead member loads before it joins (`take_in`; the replacing itself is
`sched/supervision.py`'s). `LocalWorkers` holds `EmbeddedEngine`s in this process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncrl.gateway.engines import EngineHandle, LocalEngine, RayEngine

from .parts import Weights
from .ray_calls import died, remote
from .weight_push import DirectPush, DirectPusher

if TYPE_CHECKING:
    from asyncrl.rollout.engine import EmbeddedEngine
    from asyncrl.rollout.worker import WorkerLauncher


class RayWorkers:
    def __init__(self, launcher: WorkerLauncher, name_prefix: str, count: int) -> None:
        """`count` RolloutWorker actors from `launcher`, engines named `<name_prefix>-<i>`."""
        self.launcher = launcher
        self.ids = [f"{name_prefix}-{i}" for i in range(count)]
        """The engine ids the group started with, in slot order (a replacement takes its predecessor's slot)."""
        self.members: dict[str, Any] = {engine_id: launcher.start(engine_id, i) for i, engine_id in enumerate(self.ids)}
        self.engines: list[EngineHandle] = [RayEngine(actor, engine_id) for engine_id, actor in self.members.items()]
        """One handle per engine the group started with, for the gateway (replacements join its routing later)."""
        self.latest: tuple[Weights, int] | None = None
        """The last push, which a replacement loads (so the object store keeps these weights until the next push)."""
        self._lock = asyncio.Lock()
        self._pushed = asyncio.Event()
        self.pusher = DirectPusher()

    @property
    def actors(self) -> list:
        """The live RolloutWorker handles (replacements included, the dead left out)."""
        return list(self.members.values())

    async def push(self, weights: Weights, version: int) -> list[int]:
        async with self._lock:
            versions = await self._push(weights, version, dict(self.members))
            if any(v != version for v in versions):
                raise RuntimeError(f"pushed version {version} but workers report {versions}")
            self.latest = weights, version
            self._pushed.set()
            self._pushed = asyncio.Event()
            return versions

    async def _push(self, weights: Weights, version: int, members: dict[str, Any]) -> list[int]:
        """Each live member's version after the push (a member that died is left to its supervisor, whose
        replacement loads these weights); raises what any other failure raised."""
        if isinstance(weights, DirectPush):
            if weights.transport == "broadcast":
                # A rank that is already dead would hold an NCCL broadcast until its timeout: leave it out.
                pings = await asyncio.gather(*(remote(actor.version) for actor in members.values()), return_exceptions=True)
                members = {k: actor for (k, actor), ping in zip(members.items(), pings, strict=True) if not died(ping, actor)}
            failure, results = await self.pusher.push(weights, members, version)
        else:
            loads = [remote(actor.load_weights, weights, version) for actor in members.values()]
            failure, results = None, await asyncio.gather(*loads, return_exceptions=True)
        dead = {engine_id for (engine_id, actor), result in zip(members.items(), results, strict=True) if died(result, actor)}
        broadcast = isinstance(weights, DirectPush) and weights.transport == "broadcast"
        if broadcast and dead and (failure is None or not died(failure, weights.learner)):
            # One broadcast fails for every rank when one dies: again, in a group without the dead.
            return await self._push(weights, version, {k: a for k, a in members.items() if k not in dead})
        if failure is not None:
            raise failure
        for (engine_id, _), result in zip(members.items(), results, strict=True):
            if isinstance(result, BaseException) and engine_id not in dead:
                raise result
        return [result for result in results if not isinstance(result, BaseException)]

    async def ready(self) -> None:
        """Wait until every worker's engine is built (a gateway heartbeating them sooner would drop them)."""
        await asyncio.gather(*(remote(actor.version) for actor in self.members.values()))

    async def versions(self) -> list[int]:
        return await self._ask_all("version")

    async def health(self) -> list[dict]:
        return await self._ask_all("health")

    async def _ask_all(self, verb: str) -> list:
        members = list(self.members.values())
        results = await asyncio.gather(*(remote(getattr(actor, verb)) for actor in members), return_exceptions=True)
        for actor, result in zip(members, results, strict=True):
            if isinstance(result, BaseException) and not died(result, actor):
                raise result
        return [result for result in results if not isinstance(result, BaseException)]

    def drop(self, engine_id: str) -> None:
        """A member that died leaves the pushes (its supervisor takes it out of routing)."""
        self.members.pop(engine_id, None)

    async def take_in(self, engine_id: str, actor: Any, joined: Callable[[EngineHandle], None]) -> int | None:
        """Load the latest push into `actor`, then make it a member and call `joined` with its handle (to route
        to it), with no push in between; returns the version it serves (None before the first push)."""
        import ray

        while True:
            async with self._lock:
                weights, version = self.latest or (None, None)
                try:
                    if isinstance(weights, DirectPush):  # the pushed weights live in the engines only
                        weights, version = await weights.current()
                    if weights is not None:
                        await remote(actor.load_weights, weights, version)
                except ray.exceptions.RayActorError as error:
                    if died(error, actor):
                        raise
                    next_push = self._pushed  # these weights died with their learner; the loop pushes others
                else:
                    self.members[engine_id] = actor
                    joined(RayEngine(actor, engine_id))
                    return version
            await next_push.wait()


class RayEvaluationEngine:
    """`eval.engine: own` over Ray (`sched/evaluation.py` EvaluationEngine): one more RolloutWorker from the
    run's launcher, in no push and no training routing; it loads the weights of the pushes evaluated."""

    def __init__(self, launcher: WorkerLauncher, engine_id: str) -> None:
        self.actor = launcher.start_aside(engine_id)
        self.handle: EngineHandle = RayEngine(self.actor, engine_id)

    async def load(self, weights: Weights, version: int) -> None:
        if isinstance(weights, DirectPush):  # the learner sent them to the engines itself: ask it for a copy
            weights, version = await weights.current()
        await remote(self.actor.load_weights, weights, version)


class LocalEvaluationEngine:
    """`eval.engine: own` in this process: an `EmbeddedEngine` of its own."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine
        self.handle: EngineHandle = LocalEngine(engine)

    async def load(self, weights: Weights, version: int) -> None:
        await asyncio.to_thread(self.engine.update_weights, weights, version)


class LocalWorkers:
    def __init__(self, engines: list[EmbeddedEngine]) -> None:
        self.local = engines
        self.engines: list[EngineHandle] = [LocalEngine(engine) for engine in engines]

    async def push(self, weights: Weights, version: int) -> list[int]:
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
