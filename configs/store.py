"""The trajectory store section: SQLite or Redis (a choice by `store.type`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Tag

from .section import Section, choice


class StoreBase(Section):
    """What every trajectory store shares: how the learner claims trajectories."""

    visibility_timeout_s: float = Field(300.0, gt=0)
    """How long a claimed, unacknowledged trajectory stays with its consumer before it is handed out again."""
    claim_block_s: float = Field(1.0, ge=0)
    """How long one learner claim waits for completed trajectories."""
    claim_batch: int = Field(64, ge=1)
    """Most trajectories one claim takes."""
    keep_trajectories: bool = True
    """Keep trajectories after the learner acknowledged them (replay reads them; `asyncrl replay prune`
    deletes them later); false deletes each one once a checkpoint holds its training."""


class SQLiteStoreConfig(StoreBase):
    """The trajectory store as an embedded SQLite file: one machine, nothing to run."""

    type: Literal["sqlite"] = "sqlite"
    """Backend: an embedded SQLite file (one machine)."""
    path: str | None = None
    """SQLite file; None means <run directory>/trajectories.db."""


class RedisStoreConfig(StoreBase):
    """The trajectory store on a Redis server: gateways and learners on many machines."""

    type: Literal["redis"] = "redis"
    """Backend: a Redis server (many machines)."""
    url: str = "redis://127.0.0.1:6379/0"
    """Redis server address."""
    namespace: str | None = None
    """Redis key prefix; None means the run name."""


StoreConfig = Annotated[
    Annotated[SQLiteStoreConfig, Tag("sqlite")] | Annotated[RedisStoreConfig, Tag("redis")],
    choice("type", "sqlite", "redis"),
]
"""The store section: `type` picks the backend, and each backend has the fields that apply to it."""
