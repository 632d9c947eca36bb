"""Keeping a worker group's engines serving when one dies (`sched/parts.py` WorkerSupervision).

`RaySupervisor` parks a `watch` call on each RolloutWorker, which fails the moment Ray learns the actor
died. The dead engine then leaves the gateway's routing (its requests fail over or fail) and the pushes;
a replacement starts from the group's launcher in the same slot, loads the latest pushed weights and
version with no push in between (`RayWorkers.take_in`), and only then joins routing, under a new engine
id, so every recorded turn names the process that sampled it. The loop reads what happened
(`replaced`) and stops the run when a replacement could not be made (`check`). In-process engines live
and die with the process: `Unsupervised` has nothing to replace.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from typing import TYPE_CHECKING, Any

from .ray_calls import died, remote

if TYPE_CHECKING:
    from asyncrl.gateway.pool import Routing

    from .workers import RayWorkers

REPLACEMENT_STARTS = 3
"""Replacement actors tried for one dead worker (each one that dies while starting counts) before the run stops."""


class RaySupervisor:
    def __init__(self, workers: RayWorkers) -> None:
        """Supervises `workers`' members once attached; a replacement of `<prefix>-<i>` is `<prefix>-<i>-r<n>`."""
        self.workers = workers
        self._slot = {engine_id: (engine_id, i) for i, engine_id in enumerate(workers.ids)}
        """Each live engine's slot: the first engine's id and index (its bundle when placement-grouped)."""
        self._generation = itertools.count(1)
        self._routing: Routing | None = None
        self._watching: dict[str, asyncio.Task] = {}
        self._done: list[dict] = []
        self._failure: BaseException | None = None

    def attach(self, routing: Routing) -> None:
        """Start watching the engines (after the first push): one that dies leaves `routing` and the pushes;
        its replacement loads the latest pushed weights and version, then joins `routing`."""
        self._routing = routing
        for engine_id, actor in self.workers.members.items():
            self._watch(engine_id, actor)

    def serving(self) -> int:
        return len(self.workers.members)

    def replaced(self) -> list[dict]:
        done, self._done = self._done, []
        return done

    def check(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"a rollout worker died and could not be replaced: {self._failure!r}") from self._failure

    async def close(self) -> None:
        """Stop watching (before the run kills its actors: those deaths are not to be replaced)."""
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
            await remote(actor.watch)
        except ray.exceptions.RayActorError as error:
            reason = f"its Ray actor died ({type(error).__name__})"
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the watch itself broke: treat the worker as lost
            reason = f"its Ray actor could not be watched ({error!r})"
        died_at = time.time()
        self._watching.pop(engine_id, None)
        self.workers.drop(engine_id)
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

        assert self._routing is not None
        slot, began = self._slot.pop(dead_id), time.monotonic()
        for _ in range(REPLACEMENT_STARTS):
            new_id = f"{slot[0]}-r{next(self._generation)}"
            actor = self.workers.launcher.start(new_id, slot[1])
            try:
                await remote(actor.version)  # its engine is built
                version = await self.workers.take_in(new_id, actor, self._routing.add_local)
            except asyncio.CancelledError:
                ray.kill(actor)
                raise
            except ray.exceptions.RayActorError as error:
                if not died(error, actor):
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


class Unsupervised:
    """The supervision of in-process engines: they live and die with this process, so there is nothing to
    watch or replace."""

    def __init__(self, engines: int) -> None:
        self.engines = engines

    def attach(self, routing: Routing) -> None:
        return None

    def serving(self) -> int:
        return self.engines

    def replaced(self) -> list[dict]:
        return []

    def check(self) -> None:
        return None

    async def close(self) -> None:
        return None
