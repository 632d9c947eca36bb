"""Which engines are alive, and how many requests each has in flight.

Engines register and then send heartbeats. One that has been silent for longer than the heartbeat
timeout is deregistered the next time anyone looks (`alive`, `loads`, `acquire`, or the gateway's
periodic `expire`), and subscribers such as the router hear about it, so new requests go elsewhere.
Time comes from an injected clock, so tests move time by hand instead of sleeping.

In-flight counts are leases tied to one registration of an engine: a request that started before
its engine expired and re-registered releases nothing on the new registration, so counts stay true.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal


class UnknownEngineError(LookupError):
    """The engine is not registered (never was, or it expired)."""


@dataclass
class EngineInfo:
    id: str
    handle: Any
    """How the gateway reaches the engine: an address, a Ray actor handle, an in-process object."""
    capacity: float
    """Relative capacity: 2.0 takes twice the share of rollouts of a 1.0 engine."""
    registered_at: float
    last_heartbeat: float
    in_flight: int = 0
    health: dict = field(default_factory=dict)
    """The latest `Engine.health()` report sent with a heartbeat."""


@dataclass(frozen=True)
class RegistryEvent:
    kind: Literal["registered", "deregistered"]
    engine: EngineInfo
    reason: str
    """registered | updated | heartbeat timeout | whatever `deregister` was given."""


class Lease:
    """One request in flight on one engine registration; `release` is idempotent."""

    def __init__(self, info: EngineInfo) -> None:
        self.info, self.released = info, False

    @property
    def engine_id(self) -> str:
        return self.info.id

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.info.in_flight -= 1

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class EngineRegistry:
    def __init__(self, heartbeat_timeout_s: float = 10.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be positive, got {heartbeat_timeout_s}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        self._engines: dict[str, EngineInfo] = {}
        self._subscribers: list[Callable[[RegistryEvent], None]] = []

    def subscribe(self, callback: Callable[[RegistryEvent], None]) -> None:
        """Call `callback(event)` after every registration and deregistration (e.g. `Router.apply`)."""
        self._subscribers.append(callback)

    def register(self, engine_id: str, handle: Any, capacity: float = 1.0, health: dict | None = None) -> EngineInfo:
        """Add an engine, or update a live one in place (its in-flight count carries on)."""
        if not engine_id:
            raise ValueError("engine_id must be non-empty")
        if not capacity > 0:
            raise ValueError(f"capacity of {engine_id!r} must be positive, got {capacity}")
        self.expire()
        now = self.clock()
        info = self._engines.get(engine_id)
        if info is None:
            info = self._engines[engine_id] = EngineInfo(engine_id, handle, capacity, now, now)
            reason = "registered"
        else:
            info.handle, info.capacity, info.last_heartbeat = handle, capacity, now
            reason = "updated"
        info.health = dict(health or {})
        self._emit(RegistryEvent("registered", info, reason))
        return info

    def heartbeat(self, engine_id: str, health: dict | None = None) -> bool:
        """Record a heartbeat. False means the engine is not registered (it expired): register again."""
        self.expire()
        info = self._engines.get(engine_id)
        if info is None:
            return False
        info.last_heartbeat = self.clock()
        if health is not None:
            info.health = dict(health)
        return True

    def deregister(self, engine_id: str, reason: str = "deregistered") -> bool:
        info = self._engines.pop(engine_id, None)
        if info is not None:
            self._emit(RegistryEvent("deregistered", info, reason))
        return info is not None

    def expire(self) -> list[str]:
        """Deregister every engine silent for longer than the timeout; returns their ids."""
        deadline = self.clock() - self.heartbeat_timeout_s
        dead = [e.id for e in self._engines.values() if e.last_heartbeat < deadline]
        for engine_id in dead:
            self.deregister(engine_id, "heartbeat timeout")
        return dead

    def alive(self) -> list[EngineInfo]:
        self.expire()
        return list(self._engines.values())

    def get(self, engine_id: str) -> EngineInfo:
        self.expire()
        if engine_id not in self._engines:
            raise UnknownEngineError(f"engine {engine_id!r} is not registered")
        return self._engines[engine_id]

    def loads(self) -> dict[str, int]:
        """engine id -> requests in flight, for the router."""
        return {e.id: e.in_flight for e in self.alive()}

    def acquire(self, engine_id: str) -> Lease:
        """Count one request in flight on a live engine until the lease is released."""
        info = self.get(engine_id)
        info.in_flight += 1
        return Lease(info)

    def _emit(self, event: RegistryEvent) -> None:
        for callback in list(self._subscribers):
            callback(event)
