"""The driver's side of the direct pushes (`rollout.weight_transport`, `asyncrl/weight_transfer.py`).

The weights never pass through the driver or the object store: at push time the driver has the learner
hand them to the engines itself, and waits for all of them.

- `broadcast`: one torch.distributed group (learner rank 0, engines 1..N), opened once per set of
  engines and learner: a replacement engine, or a restarted learner, opens the next generation at the
  next push. A rank that dies fails the broadcast for all; the push then runs again without it.
- `cuda_ipc`: the engines share the learner's GPU; bucket by bucket, the learner packs its weights into
  a buffer and hands out a CUDA IPC handle to it, and every engine copies the bucket out.

A replacement engine cannot join a push in the middle of a run's pushes, so it starts from the learner's
current weights, through the object store, at the version they are (`DirectPush.current`): newer than
the other engines' at most by the steps since the last push, which every token records.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from asyncrl.weight_transfer import resolve_transport

from .ray_calls import remote

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DirectPush:
    """The weights of a direct push, as the learner client hands them to the worker group: the learner
    sends them itself when the push runs, so it cannot train meanwhile (`Loop.finish_step` waits)."""

    learner: Any
    """The LearnerActor (rank 0)."""
    transport: str
    """broadcast or cuda_ipc (`resolve_transport`)."""
    backend: str | None = None
    """The broadcast's: nccl or gloo."""

    async def current(self) -> tuple[Any, int]:
        """The learner's weights now, as an ObjectRef, and their version (for a replacement engine)."""
        state, version = self.learner.versioned_state.options(num_returns=2).remote()
        return state, await asyncio.wrap_future(version.future())


class DirectPusher:
    """Runs direct pushes for one worker group; for broadcasts, opens a new group generation when its
    engines or its learner changed."""

    def __init__(self) -> None:
        self.generation = 0
        self._members: tuple[str, ...] = ()
        self._learner: Any = None
        self._address: tuple[str, int] | None = None

    async def push(self, weights: DirectPush, members: dict[str, Any], version: int) -> tuple[BaseException | None, list]:
        """The learner's weights to `members` (engine id -> RolloutWorker) as `version`: the learner's
        failure (None when it sent) and each member's result (its version, or its exception)."""
        if weights.transport == "cuda_ipc":
            return await self._share(weights.learner, members, version)
        return await self._broadcast(weights, members, version)

    async def _broadcast(self, weights: DirectPush, members: dict[str, Any], version: int) -> tuple[BaseException | None, list]:
        world = len(members) + 1
        if tuple(members) != self._members or weights.learner is not self._learner:
            self.generation += 1
            self._address = await remote(weights.learner.open_weight_group, world, self.generation)
            self._members, self._learner = tuple(members), weights.learner
        layout = await remote(weights.learner.weight_layout)
        calls = [
            remote(actor.receive_weights, self._address, self.generation, rank, world, weights.backend, layout, version)
            for rank, actor in enumerate(members.values(), start=1)
        ]
        send = remote(weights.learner.send_weights, self.generation, weights.backend, layout)
        sent, *received = await asyncio.gather(send, *calls, return_exceptions=True)
        failure = sent if isinstance(sent, BaseException) else None
        if failure is not None or any(isinstance(result, BaseException) for result in received):
            self._members = ()  # a rank may be gone: a new group at the next push
        return failure, received

    async def _share(self, learner: Any, members: dict[str, Any], version: int) -> tuple[BaseException | None, list]:
        results: list = [None] * len(members)
        try:
            layout = await remote(learner.weight_layout)
            actors = list(members.values())
            for bucket in range(len(layout.bucket_sizes)):
                handle = await remote(learner.share_bucket, layout, bucket)
                live = [index for index, result in enumerate(results) if result is None]  # a failed member is left out
                copied = [remote(actors[index].copy_shared_bucket, layout, bucket, handle) for index in live]
                for index, result in zip(live, await asyncio.gather(*copied, return_exceptions=True), strict=True):
                    if isinstance(result, BaseException):
                        results[index] = result
        except Exception as failure:
            return failure, results
        finally:
            await asyncio.gather(remote(learner.release_shared), return_exceptions=True)
        copied_all = [actor for actor, result in zip(members.values(), results, strict=True) if result is None]
        swaps = [remote(actor.swap_in_shared, layout, version) for actor in copied_all]
        swapped = iter(await asyncio.gather(*swaps, return_exceptions=True))
        return None, [result if result is not None else next(swapped) for result in results]


async def direct_transport(wanted: str, learner: Any, workers: list) -> tuple[str, str | None] | None:
    """How pushes reach the engines (`rollout.weight_transport`, resolved for the devices the learner actor
    and the RolloutWorkers report): a `DirectPush`'s transport and backend, or None for the object store."""
    if wanted == "object_store":
        return None
    devices = await asyncio.gather(remote(learner.device_identity), *(remote(worker.device_identity) for worker in workers))
    transport, backend = resolve_transport(wanted, devices[0], list(devices[1:]))
    log.info("weight pushes: %s%s (rollout.weight_transport=%s)", transport, f" over {backend}" if backend else "", wanted)
    return None if transport == "object_store" else (transport, backend)
