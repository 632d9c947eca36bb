"""The learner and worker-group clients (`sched/parts.py`), over Ray actors or in this process.

`RayLearner` and `RayWorkers` wrap the LearnerActor and RolloutWorker handles `asyncrl run` starts:
the weights leave the learner as one ObjectRef that every worker reads (`learner/publish.py`), so
they never pass through the driver. `LocalLearner` and `LocalWorkers` hold an `RLLearner` and
`EmbeddedEngine`s in this process: the learner steps on a thread, so episodes run on meanwhile as
they do beside the actors, and the loop is the same loop without Ray.

`RayWorkers` keeps its engines serving when a worker dies: each worker has a `watch` call parked on
it, which fails the moment Ray learns the actor died. The dead engine then leaves the gateway's
routing (its requests fail over or fail) and the pushes; a replacement starts from the same launcher,
loads the latest pushed weights and version under the push lock (so no push slips in between), and
only then joins routing, under a new engine id, so every recorded turn names the process that
sampled it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncrl.gateway.engines import EngineHandle, LocalEngine, RayEngine
from asyncrl.gateway.pool import Routing
from asyncrl.records import Batch, StepResult

from .parts import LearnerDied, Weights
from .weight_push import DirectPush, DirectPusher

if TYPE_CHECKING:
    from asyncrl.learner.rl import RLLearner
    from asyncrl.rollout.engine import EmbeddedEngine
    from asyncrl.rollout.worker import WorkerLauncher

REPLACEMENT_STARTS = 3
"""Replacement actors tried for one dead worker (each one that dies while starting counts) before the run stops."""


def _remote(method, *args) -> asyncio.Future:
    """A Ray actor call as an asyncio future."""
    return asyncio.wrap_future(method.remote(*args).future())


def _creation_failure(error: BaseException) -> str:
    """`: <the exception>` when the actor died of an error in its constructor (say a checkpoint that is not on
    its node's disk), else nothing: Ray's message puts the exception on its last line."""
    text = str(error)
    return f": {text.strip().splitlines()[-1]}" if "error raised in its creation task" in text else ""


def _died(error: BaseException, actor: Any) -> bool:
    """Whether `error` says that `actor` itself is gone (not, say, the learner whose weights it was handed)."""
    import ray

    return isinstance(error, ray.exceptions.RayActorError) and getattr(error, "actor_id", None) in (None, actor._actor_id.hex())


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
            return await _remote(method, *args)
        except ray.exceptions.RayActorError as error:
            if not _died(error, self.actor):
                raise
            raise LearnerDied(f"the learner actor died: {type(error).__name__}{_creation_failure(error)}") from error


class RayWorkers:
    def __init__(self, launcher: WorkerLauncher, name_prefix: str, count: int) -> None:
        """`count` RolloutWorker actors from `launcher`, engines named `<name_prefix>-<i>`; a replacement
        of `<name_prefix>-<i>` is `<name_prefix>-<i>-r<n>`."""
        self.launcher = launcher
        ids = [f"{name_prefix}-{i}" for i in range(count)]
        self.members: dict[str, Any] = {engine_id: launcher.start(engine_id, i) for i, engine_id in enumerate(ids)}
        self.engines: list[EngineHandle] = [RayEngine(actor, engine_id) for engine_id, actor in self.members.items()]
        self.latest: tuple[Weights, int] | None = None
        """The last push, which a replacement loads (so the object store keeps these weights until the next push)."""
        self._slot = {engine_id: (engine_id, i) for i, engine_id in enumerate(ids)}
        """Each live engine's slot: the first engine's id and index (its bundle when placement-grouped)."""
        self._generation = itertools.count(1)
        self._lock = asyncio.Lock()
        self._pushed = asyncio.Event()
        self.pusher = DirectPusher()
        self._routing: Routing | None = None
        self._watching: dict[str, asyncio.Task] = {}
        self._done: list[dict] = []
        self._failure: BaseException | None = None

    @property
    def actors(self) -> list:
        """The live RolloutWorker handles (replacements included, the dead left out)."""
        return list(self.members.values())

    async def update_weights(self, weights: Weights, version: int) -> list[int]:
        async with self._lock:
            versions = await self._push(weights, version, dict(self.members))
            if any(v != version for v in versions):
                raise RuntimeError(f"pushed version {version} but workers report {versions}")
            self.latest = weights, version
            self._pushed.set()
            self._pushed = asyncio.Event()
            return versions

    async def _push(self, weights: Weights, version: int, members: dict[str, Any]) -> list[int]:
        """Each live member's version after the push (a member that died is left to its watcher, whose
        replacement loads these weights); raises what any other failure raised."""
        if isinstance(weights, DirectPush):
            if weights.transport == "broadcast":
                # A rank that is already dead would hold an NCCL broadcast until its timeout: leave it out.
                pings = await asyncio.gather(*(_remote(actor.version) for actor in members.values()), return_exceptions=True)
                members = {k: actor for (k, actor), ping in zip(members.items(), pings, strict=True) if not _died(ping, actor)}
            failure, results = await self.pusher.push(weights, members, version)
        else:
            loads = [_remote(actor.update_weights, weights, version) for actor in members.values()]
            failure, results = None, await asyncio.gather(*loads, return_exceptions=True)
        dead = {engine_id for (engine_id, actor), result in zip(members.items(), results, strict=True) if _died(result, actor)}
        broadcast = isinstance(weights, DirectPush) and weights.transport == "broadcast"
        if broadcast and dead and (failure is None or not _died(failure, weights.learner)):
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
        await asyncio.gather(*(_remote(actor.version) for actor in self.members.values()))

    async def versions(self) -> list[int]:
        return await self._ask_all("version")

    async def health(self) -> list[dict]:
        return await self._ask_all("health")

    async def _ask_all(self, verb: str) -> list:
        members = list(self.members.values())
        results = await asyncio.gather(*(_remote(getattr(actor, verb)) for actor in members), return_exceptions=True)
        for actor, result in zip(members, results, strict=True):
            if isinstance(result, BaseException) and not _died(result, actor):
                raise result
        return [result for result in results if not isinstance(result, BaseException)]

    # -- replacing the dead ---------------------------------------------------------------------

    def attach(self, routing: Routing) -> None:
        self._routing = routing
        for engine_id, actor in self.members.items():
            self._watch(engine_id, actor)

    def serving(self) -> int:
        return len(self.members)

    def replaced(self) -> list[dict]:
        done, self._done = self._done, []
        return done

    def check(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"a rollout worker died and could not be replaced: {self._failure!r}") from self._failure

    async def close(self) -> None:
        watching = list(self._watching.values())
        self._watching.clear()
        for task in watching:
            task.cancel()
        await asyncio.gather(*watching, return_exceptions=True)

    def _watch(self, engine_id: str, actor: Any) -> None:
        self._watching[engine_id] = asyncio.ensure_future(self._supervise(engine_id, actor))

    async def _supervise(self, engine_id: str, actor: Any) -> None:
        import ray

        try:
            await _remote(actor.watch)
        except ray.exceptions.RayActorError as error:
            reason = f"its Ray actor died ({type(error).__name__})"
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the watch itself broke: treat the worker as lost
            reason = f"its Ray actor could not be watched ({error!r})"
        died_at = time.time()
        self._watching.pop(engine_id, None)
        self.members.pop(engine_id, None)
        assert self._routing is not None
        self._routing.remove_local(engine_id, reason)
        with contextlib.suppress(Exception):
            ray.kill(actor)  # a worker that only looked dead must not serve on beside its replacement
        try:
            await self._replace(engine_id, died_at)
        except asyncio.CancelledError:
            raise
        except Exception as failure:  # the loop raises it (`check`)
            self._failure = failure

    async def _replace(self, dead_id: str, died_at: float) -> None:
        import ray

        slot, began = self._slot.pop(dead_id), time.monotonic()
        for _ in range(REPLACEMENT_STARTS):
            new_id = f"{slot[0]}-r{next(self._generation)}"
            actor = self.launcher.start(new_id, slot[1])
            try:
                await _remote(actor.version)  # its engine is built
                version = await self._join(new_id, actor)
            except asyncio.CancelledError:
                ray.kill(actor)
                raise
            except ray.exceptions.RayActorError as error:
                if not _died(error, actor):
                    raise
                continue  # it died while starting: another one
            break
        else:
            raise RuntimeError(f"{REPLACEMENT_STARTS} replacements of {dead_id} died while starting")
        self._slot[new_id] = slot
        self._done.append({
            "engine_id": dead_id, "replacement": new_id, "version": version, "died_at": died_at,
            "serving_at": time.time(), "recovery_s": time.monotonic() - began,
        })  # fmt: skip
        self._watch(new_id, actor)

    async def _join(self, engine_id: str, actor: Any) -> int | None:
        """Load the latest push into `actor`, then add it to the members and routing, with no push in
        between; returns the version it serves (None before the first push)."""
        import ray

        while True:
            async with self._lock:
                weights, version = self.latest or (None, None)
                try:
                    if isinstance(weights, DirectPush):  # the pushed weights live in the engines only
                        weights, version = await weights.current()
                    if weights is not None:
                        await _remote(actor.update_weights, weights, version)
                except ray.exceptions.RayActorError as error:
                    if _died(error, actor):
                        raise
                    next_push = self._pushed  # these weights died with their learner; the loop pushes others
                else:
                    self.members[engine_id] = actor
                    assert self._routing is not None
                    self._routing.add_local(RayEngine(actor, engine_id))
                    return version
            await next_push.wait()


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

    # In-process engines live and die with this process: there is nothing to replace.

    def attach(self, routing: Routing) -> None:
        return None

    def serving(self) -> int:
        return len(self.local)

    def replaced(self) -> list[dict]:
        return []

    def check(self) -> None:
        return None

    async def close(self) -> None:
        return None
