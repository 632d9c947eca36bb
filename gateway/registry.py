"""Which engines are alive, and how many requests each has in flight.

Engines register and then send heartbeats. One that has been silent for longer than the heartbeat
timeout is deregistered the next time anyone looks (`alive`, `loads`, `acquire`, or the gateway's
periodic `expire`), and subscribers such as the router hear about it, so new requests go elsewhere.
Time comes from an injected clock, so tests move time by hand instead of sleeping.

In-flight counts are leases tied to one registration of an engine: a request that started before
its engine expired and re-registered releases nothing on the new registration, so counts stay true.

An engine id belongs to whoever registered it while it is alive: the first registration returns a
random `holder` secret (the `lease` of the HTTP API), and a heartbeat or a re-registration of a live id
must present it. Nobody can take over a live engine; once it expired (or deregistered) the id is free
again. Registration work and memory are bounded: at most MAX_ENGINES engines, each of capacity at most
MAX_CAPACITY, MAX_TOTAL_CAPACITY in all (the router's ring holds route_vnodes points per unit).
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

MAX_CAPACITY = 64.0
"""Largest relative capacity of one engine (an engine that big takes 64 times a 1.0 engine's share)."""
MAX_ENGINES = 1024
"""Most engines registered at once."""
MAX_TOTAL_CAPACITY = 4096.0
"""Most capacity registered at once: with the default 128 route_vnodes, a ring of half a million points."""


class UnknownEngineError(LookupError):
    """The engine is not registered (never was, or it expired)."""


class EngineIdTaken(PermissionError):
    """A live engine id was presented without the holder secret its registration returned."""


class RegistryFull(RuntimeError):
    """MAX_ENGINES engines or MAX_TOTAL_CAPACITY are registered; more has to wait for one to leave."""


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
    holder: str = field(default="", repr=False)
    """The secret that heartbeats and re-registrations of this id must present while it is alive."""


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

    def register(
        self, engine_id: str, handle: Any, capacity: float = 1.0, health: dict | None = None, *, holder: str | None = None
    ) -> EngineInfo:
        """Add an engine (its `holder` secret is new), or update a live one in place (its in-flight count
        carries on), which takes that engine's `holder`: EngineIdTaken otherwise."""
        if not engine_id:
            raise ValueError("engine_id must be non-empty")
        if not 0 < capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity of {engine_id!r} must be in (0, {MAX_CAPACITY:g}], got {capacity}")
        self.expire()
        now = self.clock()
        info = self._engines.get(engine_id)
        if info is not None:
            self._check_holder(info, holder)
        if info is None and len(self._engines) >= MAX_ENGINES:
            raise RegistryFull(f"{MAX_ENGINES} engines are registered, the most one gateway takes; {engine_id!r} was not added")
        total = sum(e.capacity for e in self._engines.values()) - (info.capacity if info else 0.0) + capacity
        if total > MAX_TOTAL_CAPACITY:
            raise RegistryFull(f"capacity {capacity} of {engine_id!r} would make {total:g} in all; the most is {MAX_TOTAL_CAPACITY:g}")
        if info is None:
            info = self._engines[engine_id] = EngineInfo(engine_id, handle, capacity, now, now, holder=secrets.token_urlsafe(24))
            reason = "registered"
        else:
            info.handle, info.capacity, info.last_heartbeat = handle, capacity, now
            reason = "updated"
        info.health = dict(health or {})
        self._emit(RegistryEvent("registered", info, reason))
        return info

    def heartbeat(self, engine_id: str, health: dict | None = None, *, holder: str | None) -> bool:
        """Record a heartbeat from the id's `holder` (EngineIdTaken otherwise). False means the engine is
        not registered (it expired): register again."""
        self.expire()
        info = self._engines.get(engine_id)
        if info is None:
            return False
        self._check_holder(info, holder)
        info.last_heartbeat = self.clock()
        if health is not None:
            info.health = dict(health)
        return True

    def leave(self, engine_id: str, holder: str | None) -> bool:
        """An engine deregistering itself: only its `holder` may (EngineIdTaken otherwise)."""
        info = self._engines.get(engine_id)
        if info is not None:
            self._check_holder(info, holder)
        return self.deregister(engine_id, "left")

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

    @staticmethod
    def _check_holder(info: EngineInfo, holder: str | None) -> None:
        if holder is None or not hmac.compare_digest(holder.encode("utf-8", "surrogateescape"), info.holder.encode()):
            raise EngineIdTaken(
                f"engine id {info.id!r} is registered and alive, and this call did not present the holder secret its "
                "registration returned; pick another engine_id, or wait until that engine has expired"
            )

    def _emit(self, event: RegistryEvent) -> None:
        for callback in list(self._subscribers):
            callback(event)
