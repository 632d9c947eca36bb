"""The driver's side of the broadcast push (`rollout.weight_transport`, `asyncrl/weight_transfer.py`).

The weights never pass through the driver or the object store: at push time the driver tells the
learner to broadcast and every engine to receive, in one group (learner rank 0, engines 1..N), and
waits for all of them. The group is opened once per set of engines and learner: a replacement engine,
or a restarted learner, opens the next generation at the next push.

A replacement engine cannot join a broadcast in the middle of a run's pushes, so it starts from the
learner's current weights, through the object store, at the version they are (`Broadcast.current`):
newer than the other engines' at most by the steps since the last push, which every token records.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from asyncrl.weight_transfer import resolve_transport

log = logging.getLogger(__name__)


def _call(method, *args) -> asyncio.Future:
    return asyncio.wrap_future(method.remote(*args).future())


@dataclass(frozen=True)
class Broadcast:
    """The weights of a broadcast push, as the learner client hands them to the workers: the learner sends
    them itself when the push runs, so it cannot train meanwhile (`Loop.finish_step` waits)."""

    learner: Any
    """The LearnerActor (rank 0)."""
    backend: str
    """nccl or gloo (`resolve_transport`)."""

    async def current(self) -> tuple[Any, int]:
        """The learner's weights now, as an ObjectRef, and their version (for a replacement engine)."""
        state, version = self.learner.versioned_state.options(num_returns=2).remote()
        return state, await asyncio.wrap_future(version.future())


class Broadcaster:
    """Runs broadcast pushes for one worker group, opening a new group generation when its engines or
    its learner changed."""

    def __init__(self) -> None:
        self.generation = 0
        self._members: tuple[str, ...] = ()
        self._learner: Any = None
        self._address: tuple[str, int] | None = None

    def forget(self) -> None:
        """Open a new group at the next push (the last one failed: a rank may be gone)."""
        self._members = ()

    async def push(self, weights: Broadcast, members: dict[str, Any], version: int) -> tuple[BaseException | None, list]:
        """Broadcast the learner's weights to `members` (engine id -> RolloutWorker) as `version`: the
        learner's failure (None when it sent) and each member's result (its version, or its exception)."""
        world = len(members) + 1
        if tuple(members) != self._members or weights.learner is not self._learner:
            self.generation += 1
            self._address = await _call(weights.learner.open_weight_group, world, self.generation)
            self._members, self._learner = tuple(members), weights.learner
        layout = await _call(weights.learner.weight_layout)
        calls = [
            _call(actor.receive_weights, self._address, self.generation, rank, world, weights.backend, layout, version)
            for rank, actor in enumerate(members.values(), start=1)
        ]
        send = _call(weights.learner.send_weights, self.generation, weights.backend)
        sent, *received = await asyncio.gather(send, *calls, return_exceptions=True)
        failure = sent if isinstance(sent, BaseException) else None
        if failure is not None or any(isinstance(result, BaseException) for result in received):
            self.forget()
        return failure, received


async def broadcast_backend(wanted: str, learner: Any, workers: list) -> str | None:
    """The backend pushes broadcast over (`rollout.weight_transport`, resolved for the devices the learner
    actor and the RolloutWorkers report), or None for the object store."""
    if wanted == "object_store":
        return None
    devices = await asyncio.gather(_call(learner.device_identity), *(_call(worker.device_identity) for worker in workers))
    transport, backend = resolve_transport(wanted, devices[0], list(devices[1:]))
    log.info("weight pushes: %s%s (rollout.weight_transport=%s)", transport, f" over {backend}" if backend else "", wanted)
    return backend
