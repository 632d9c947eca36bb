"""Trajectory stores: where the gateway records turns and the learner takes completed rollouts.

`open_store` picks the backend from the address: a `redis://` (or `rediss://`, `unix://`) URL is the
Redis store, anything else is a SQLite file (a directory means `trajectories.db` inside it).
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.records import Trajectory

from .base import (
    COUNT_KEYS,
    DEFAULT_VISIBILITY_TIMEOUT_S,
    ReplicaDirectory,
    RolloutClosed,
    StoreError,
    TrajectoryHandOff,
    TrajectoryReader,
    TrajectoryRecorder,
    TrajectoryStore,
    UnknownRollout,
)
from .sqlite import SQLiteStore

SQLITE_FILENAME = "trajectories.db"
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_store(
    url_or_path: str | Path,
    *,
    namespace: str = "default",
    visibility_timeout_s: float = DEFAULT_VISIBILITY_TIMEOUT_S,
) -> TrajectoryStore:
    """Open (creating if needed) the store at `url_or_path`.

    `namespace` separates runs that share one Redis server (a SQLite file is already one run).
    `visibility_timeout_s` is how long a claimed, unacked trajectory stays with its consumer before
    another claim may take it: longer than the learner's slowest step, short enough to recover soon.
    """
    address = str(url_or_path)
    if address.startswith(_REDIS_SCHEMES):
        from .redis import RedisStore  # imported here so SQLite users never need a Redis client

        return RedisStore(address, namespace=namespace, visibility_timeout_s=visibility_timeout_s)
    path = Path(address.removeprefix("sqlite:///"))
    if path.is_dir():
        path = path / SQLITE_FILENAME
    return SQLiteStore(path, visibility_timeout_s=visibility_timeout_s)


class ReadOnlyStore:
    """A `TrajectoryReader` over any store: get, list and counts, and nothing that writes (replay and
    inspection read a run this way, so they cannot change it even by mistake)."""

    def __init__(self, store: TrajectoryStore) -> None:
        self._store = store

    def __repr__(self) -> str:
        return f"ReadOnlyStore({self._store!r})"

    def get(self, rollout_id: str) -> Trajectory:
        return self._store.get(rollout_id)

    def list(
        self, *, status: str | None = None, group_id: str | None = None, limit: int | None = None, offset: int = 0
    ) -> list[Trajectory]:
        return self._store.list(status=status, group_id=group_id, limit=limit, offset=offset)

    def counts(self) -> dict[str, int]:
        return self._store.counts()

    def close(self) -> None:
        self._store.close()


def open_reader(url_or_path: str | Path, *, namespace: str = "default") -> ReadOnlyStore:
    """Open an existing store for reading only: a SQLite file is opened read-only (a missing one is
    FileNotFoundError, never created), a Redis store is reached through the reading verbs alone."""
    address = str(url_or_path)
    if address.startswith(_REDIS_SCHEMES):
        from .redis import RedisStore

        return ReadOnlyStore(RedisStore(address, namespace=namespace, read_only=True))
    path = Path(address.removeprefix("sqlite:///"))
    if path.is_dir():
        path = path / SQLITE_FILENAME
    return ReadOnlyStore(SQLiteStore(path, read_only=True))


__all__ = [
    "COUNT_KEYS",
    "DEFAULT_VISIBILITY_TIMEOUT_S",
    "ReadOnlyStore",
    "ReplicaDirectory",
    "RolloutClosed",
    "SQLiteStore",
    "StoreError",
    "TrajectoryHandOff",
    "TrajectoryReader",
    "TrajectoryRecorder",
    "TrajectoryStore",
    "UnknownRollout",
    "open_reader",
    "open_store",
]
