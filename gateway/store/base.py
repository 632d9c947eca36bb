"""The trajectory store contract, shared by the SQLite and Redis backends.

The contract is split by caller, so each sees only its verbs: `TrajectoryRecorder` (the gateway:
open, append, finish, abort), `TrajectoryHandOff` (the loop: claim, ack, counts) and
`TrajectoryReader` (inspection, export and replay: get, list, counts). `TrajectoryStore` is all
three, which every backend implements. `TrajectoryPruner` (retention: `store.keep_trajectories=false`,
`asyncrl replay prune`) deletes what the learner acknowledged; both backends implement it too, and
the read-only view replay opens (`ReadOnlyStore`) does not.

Life of a rollout: `open` -> `append` turns -> `finish` (or `abort`). Every rollout that reaches a
terminal status, aborted ones included, is handed to the consumer (the learner) exactly once:
`claim` leases it to a named consumer, `ack` ends the lease for good. A lease that is not acked
within the visibility timeout (the consumer died) is handed out again to the next `claim`, so a
learner that crashes and restarts neither loses nor double-trains a trajectory, provided it acks
within the timeout. Aborted rollouts are handed over too, so the learner can close their GRPO groups
and account for them instead of waiting.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from asyncrl.records import FINISH_STATUSES, Trajectory, Turn

COUNT_KEYS = ("running", *FINISH_STATUSES, "aborted", "pending", "claimed", "acked")
"""Keys of `counts()`: rollouts per status, then the hand-off of terminal ones: `pending` (not yet
claimed), `claimed` (leased, not acked; includes expired leases awaiting re-delivery), `acked`."""

DEFAULT_VISIBILITY_TIMEOUT_S = 300.0


class StoreError(Exception):
    """A store call the store refuses; the message says which rollout and why."""


class UnknownRollout(StoreError, LookupError):
    """No rollout with this id was ever opened in this store."""


class RolloutClosed(StoreError):
    """The rollout is already finished or aborted; it takes no more turns or status changes."""


class DeleteRefused(StoreError):
    """A delete named rollouts the learner has not acknowledged (running, or waiting to be trained)."""


@runtime_checkable
class TrajectoryRecorder(Protocol):
    """The gateway's side: rollouts opened, their turns recorded, then finished or aborted."""

    def open(self, task: str = "", group_id: str = "", metadata: dict | None = None, *, rollout_id: str | None = None) -> str:
        """Start a rollout; returns its id (a fresh one unless given). An id in use is a StoreError."""
        ...

    def append(self, turn: Turn) -> int:
        """Record a turn of a running rollout; returns the index the store gave it (0, 1, ...)."""
        ...

    def finish(self, rollout_id: str, reward: float, status: str = "ok", metrics: dict | None = None, reason: str = "") -> None:
        """End a running rollout with its reward and one of ok, env_crash, timeout, error."""
        ...

    def abort(self, rollout_id: str, reason: str = "") -> None:
        """End a running rollout without a reward (status aborted)."""
        ...

    def get(self, rollout_id: str) -> Trajectory:
        """One trajectory with all its turns; UnknownRollout if there is none (the gateway answers a
        rollout's status from it and finds a running rollout again after a restart)."""
        ...


@runtime_checkable
class TrajectoryHandOff(Protocol):
    """The loop's side: terminal trajectories handed to the learner exactly once."""

    def claim(self, consumer: str, max_n: int, block_s: float = 0.0) -> list[Trajectory]:
        """Lease up to `max_n` terminal trajectories to `consumer`, oldest first: expired leases of
        dead consumers and never-claimed ones. Waits up to `block_s` seconds when none is ready."""
        ...

    def ack(self, consumer: str, rollout_ids: Iterable[str]) -> int:
        """End `consumer`'s leases for good; returns how many it still held. A lease that expired and
        went to another consumer is not this consumer's to ack and is not counted."""
        ...

    def counts(self) -> dict[str, int]:
        """Rollouts per status and the state of the hand-off; keys are COUNT_KEYS."""
        ...


@runtime_checkable
class TrajectoryReader(Protocol):
    """Inspection, export and replay: read what was recorded, change nothing."""

    def get(self, rollout_id: str) -> Trajectory:
        """One trajectory with all its turns; UnknownRollout if there is none."""
        ...

    def list(
        self, *, status: str | None = None, group_id: str | None = None, limit: int | None = None, offset: int = 0
    ) -> list[Trajectory]:
        """Trajectories with their turns in the order they were opened, filtered, one page at a time."""
        ...

    def counts(self) -> dict[str, int]:
        """Rollouts per status and the state of the hand-off; keys are COUNT_KEYS."""
        ...


@runtime_checkable
class TrajectoryPruner(Protocol):
    """Retention's side: delete trajectories the learner is done with, and nothing else."""

    def acknowledged(self) -> list[str]:
        """Ids of every rollout the learner acknowledged (trained or accounted for at a checkpoint), oldest first."""
        ...

    def delete(self, rollout_ids: Iterable[str]) -> int:
        """Delete acknowledged rollouts with their turns; returns how many it deleted (an id no longer in
        the store is skipped: deleting twice is safe). A running or unacknowledged rollout among them
        is a `DeleteRefused` and nothing is deleted: the learner may still need it."""
        ...


@runtime_checkable
class ReplicaDirectory(Protocol):
    """Where gateway replicas over one store find each other (gateway/replicas.py): each announces its
    URL again and again, and an announcement lapses after its time to live (the replica died)."""

    def announce_replica(self, replica_id: str, url: str, ttl_s: float) -> None:
        """`replica_id` answers at `url` for the next `ttl_s` seconds."""
        ...

    def replicas(self) -> dict[str, str]:
        """Replica id -> URL of every replica whose last announcement has not lapsed."""
        ...

    def withdraw_replica(self, replica_id: str) -> None:
        """`replica_id` stops answering (a clean shutdown): its rollouts' calls are served by whoever gets them."""
        ...


@runtime_checkable
class TrajectoryStore(TrajectoryRecorder, TrajectoryHandOff, TrajectoryReader, ReplicaDirectory, Protocol):
    """What every backend implements: all three callers' sides, the replicas' directory, and `close`."""

    def close(self) -> None: ...


def check_finish(rollout_id: str, reward: float, status: str) -> None:
    if status not in FINISH_STATUSES:
        hint = " (use abort() to abort a rollout)" if status == "aborted" else ""
        raise StoreError(f"rollout {rollout_id!r}: finish status must be one of {', '.join(FINISH_STATUSES)}, got {status!r}{hint}")
    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
        raise StoreError(f"rollout {rollout_id!r}: reward must be a finite number, got {reward!r}")


def check_claim(consumer: str, max_n: int, block_s: float) -> None:
    if not consumer:
        raise StoreError("claim needs a consumer name (it owns the leases until it acks them)")
    if max_n < 1:
        raise StoreError(f"claim max_n must be at least 1, got {max_n}")
    if block_s < 0:
        raise StoreError(f"claim block_s must be >= 0, got {block_s}")


def check_index(turn: Turn, index: int) -> None:
    """A caller that numbers its own turns must agree with the store (it catches lost or doubled turns)."""
    if turn.index not in (-1, index):
        raise StoreError(
            f"rollout {turn.rollout_id!r}: turn says index {turn.index} but it would be turn {index}; "
            "leave index at -1 to let the store number turns"
        )


def turn_json(turn: Turn) -> str:
    """The stored form of a turn. The index is left out: the store keeps it as the turn's position."""
    data = turn.to_dict()
    del data["index"]
    data["created_at"] = turn.created_at or time.time()
    return json.dumps(data, separators=(",", ":"))


def turn_from_json(text: str, index: int) -> Turn:
    """A stored turn; fields it was stored without (a turn's sampling options, in stores written before
    turns carried them) take the Turn's defaults."""
    return Turn.from_dict({**json.loads(text), "index": index})


def closed_error(rollout_id: str, status: str, verb: str) -> RolloutClosed:
    return RolloutClosed(f"rollout {rollout_id!r} is {status}; cannot {verb} it")


def delete_refused(refused: list[tuple[str, str]]) -> DeleteRefused:
    """`refused`: (rollout id, status) of each rollout a delete may not touch."""
    shown = ", ".join(f"{rid!r} ({'running' if status == 'running' else status + ', not acknowledged'})" for rid, status in refused[:8])
    more = f" and {len(refused) - 8} more" if len(refused) > 8 else ""
    return DeleteRefused(
        f"cannot delete {len(refused)} rollout(s) the learner has not acknowledged: {shown}{more}; "
        "only acknowledged trajectories can be deleted (nothing was deleted)"
    )


def unknown_error(rollout_id: str) -> UnknownRollout:
    return UnknownRollout(f"no rollout {rollout_id!r} in this store (never opened, or another run's store)")
