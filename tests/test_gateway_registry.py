"""Engine registration, heartbeats with an injected clock, in-flight leases, holder secrets, bounds, and the
router following along."""

from __future__ import annotations

import pytest

from asyncrl.gateway.registry import (
    MAX_CAPACITY,
    MAX_ENGINES,
    MAX_TOTAL_CAPACITY,
    EngineIdTaken,
    EngineRegistry,
    RegistryFull,
    UnknownEngineError,
)
from asyncrl.gateway.routing import Router


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def registry(clock: Clock) -> EngineRegistry:
    return EngineRegistry(heartbeat_timeout_s=5.0, clock=clock)


def events_of(registry: EngineRegistry) -> list[tuple[str, str, str]]:
    seen: list[tuple[str, str, str]] = []
    registry.subscribe(lambda e: seen.append((e.kind, e.engine.id, e.reason)))
    return seen


def test_register_and_alive(registry: EngineRegistry) -> None:
    seen = events_of(registry)
    info = registry.register("e0", handle="http://127.0.0.1:9000", capacity=2.0, health={"version": 3})
    assert (info.handle, info.capacity, info.health, info.in_flight) == ("http://127.0.0.1:9000", 2.0, {"version": 3}, 0)
    assert [e.id for e in registry.alive()] == ["e0"]
    assert registry.loads() == {"e0": 0}
    assert seen == [("registered", "e0", "registered")]


def test_silent_engine_expires_after_the_window(registry: EngineRegistry, clock: Clock) -> None:
    seen = events_of(registry)
    e0 = registry.register("e0", None)
    e1 = registry.register("e1", None)
    clock.now += 4.0
    assert registry.heartbeat("e0", {"running": 1}, holder=e0.holder)
    clock.now += 5.0  # e0 beat 5 s ago: exactly the window, still alive; e1 silent for 9 s
    assert [e.id for e in registry.alive()] == ["e0"]
    assert registry.get("e0").health == {"running": 1}
    assert seen[-1] == ("deregistered", "e1", "heartbeat timeout")
    assert not registry.heartbeat("e1", holder=e1.holder)  # told to register again
    clock.now += 0.001
    assert registry.expire() == ["e0"] and registry.alive() == []


def test_leases_count_in_flight_requests(registry: EngineRegistry) -> None:
    registry.register("e0", None)
    first = registry.acquire("e0")
    with registry.acquire("e0") as second:
        assert registry.loads() == {"e0": 2} and second.engine_id == "e0"
    assert registry.loads() == {"e0": 1}
    first.release()
    first.release()  # idempotent: a retry path releasing twice cannot drive the count negative
    assert registry.loads() == {"e0": 0}
    with pytest.raises(UnknownEngineError, match="'nope'"):
        registry.acquire("nope")


def test_lease_from_an_expired_registration_does_not_touch_the_new_one(registry: EngineRegistry, clock: Clock) -> None:
    registry.register("e0", "old")
    stale = registry.acquire("e0")
    clock.now += 10.0
    registry.register("e0", "new")  # the engine came back after expiring
    fresh = registry.acquire("e0")
    stale.release()
    assert registry.loads() == {"e0": 1}
    fresh.release()
    assert registry.loads() == {"e0": 0}


def test_re_registering_a_live_engine_updates_it_in_place(registry: EngineRegistry) -> None:
    seen = events_of(registry)
    holder = registry.register("e0", "a").holder
    lease = registry.acquire("e0")
    registry.register("e0", "b", capacity=3.0, holder=holder)
    info = registry.get("e0")
    assert (info.handle, info.capacity, info.in_flight, info.holder) == ("b", 3.0, 1, holder)
    lease.release()
    assert info.in_flight == 0
    assert [r for _, _, r in seen] == ["registered", "updated"]


def test_a_live_engine_id_answers_only_to_its_holder(registry: EngineRegistry, clock: Clock) -> None:
    holder = registry.register("e0", "real").holder
    for wrong in (None, "", "guess", holder[:-1]):
        with pytest.raises(EngineIdTaken, match="'e0'"):
            registry.register("e0", "fake", holder=wrong)
        with pytest.raises(EngineIdTaken, match="'e0'"):
            registry.heartbeat("e0", holder=wrong)
        with pytest.raises(EngineIdTaken, match="'e0'"):
            registry.leave("e0", wrong)
    assert registry.get("e0").handle == "real"
    clock.now += 6.0  # it expired: the id is free, and its old holder secret means nothing
    assert not registry.heartbeat("e0", holder=holder)
    fresh = registry.register("e0", "next")
    assert fresh.holder != holder and registry.get("e0").handle == "next"
    assert registry.leave("e0", fresh.holder) and registry.alive() == []


def test_registrations_are_bounded(registry: EngineRegistry) -> None:
    with pytest.raises(ValueError, match="capacity"):
        registry.register("big", None, capacity=MAX_CAPACITY * 2)
    for i in range(MAX_ENGINES):
        registry.register(f"e{i}", None)
    with pytest.raises(RegistryFull, match=str(MAX_ENGINES)):
        registry.register("one-more", None)


def test_the_capacity_registered_in_all_is_bounded(registry: EngineRegistry) -> None:
    holders = [registry.register(f"big{i}", None, capacity=MAX_CAPACITY).holder for i in range(int(MAX_TOTAL_CAPACITY // MAX_CAPACITY))]
    with pytest.raises(RegistryFull, match="in all"):
        registry.register("one-more", None, capacity=1.0)
    registry.register("big0", None, capacity=MAX_CAPACITY / 2, holder=holders[0])  # shrinking frees room
    assert registry.register("one-more", None, capacity=1.0).capacity == 1.0


def test_deregister(registry: EngineRegistry) -> None:
    seen = events_of(registry)
    registry.register("e0", None)
    assert registry.deregister("e0", "shutdown") and not registry.deregister("e0")
    assert seen[-1] == ("deregistered", "e0", "shutdown")
    with pytest.raises(UnknownEngineError):
        registry.get("e0")


def test_bad_arguments(clock: Clock) -> None:
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        EngineRegistry(0, clock=clock)
    registry = EngineRegistry(1.0, clock=clock)
    with pytest.raises(ValueError, match="capacity"):
        registry.register("e0", None, capacity=0)
    with pytest.raises(ValueError, match="engine_id"):
        registry.register("", None)


def test_router_follows_the_registry(registry: EngineRegistry, clock: Clock) -> None:
    router = Router(load_factor=0.0)
    registry.subscribe(router.apply)
    holders = {f"e{i}": registry.register(f"e{i}", None).holder for i in range(4)}
    keys = [f"rollout-{i}" for i in range(200)]
    homes = {k: router.route(k, registry.loads()) for k in keys}
    assert set(homes.values()) == {"e0", "e1", "e2", "e3"}
    clock.now += 4.0
    for engine in ("e0", "e1", "e3"):
        registry.heartbeat(engine, holder=holders[engine])
    clock.now += 2.0  # e2 missed the window
    loads = registry.loads()
    assert router.engines == ["e0", "e1", "e3"]
    after = {k: router.route(k, loads) for k in keys}
    assert "e2" not in after.values()
    assert all(after[k] == homes[k] for k in keys if homes[k] != "e2")
    # In-flight counts from the registry steer the bounded-load choice.
    victim = after[keys[0]]
    leases = [registry.acquire(victim) for _ in range(3)]
    assert router.route(keys[0], registry.loads()) != victim
    for lease in leases:
        lease.release()
    assert router.route(keys[0], registry.loads()) == victim
