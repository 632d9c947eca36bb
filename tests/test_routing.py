"""Consistent hashing with bounded loads: sticky, balanced under skew, minimal movement, deterministic."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from asyncrl.gateway.routing import MAX_POINTS_PER_NODE, HashRing, NoEngineError, Router, stable_hash

ENGINES = [f"engine-{i}" for i in range(8)]
KEYS = [f"rollout-{i}" for i in range(4000)]


def router(engines=ENGINES, **kwargs) -> Router:
    r = Router(**kwargs)
    for e in engines:
        r.add(e)
    return r


def ring_owners(keys, weights=None):
    ring = HashRing()
    for e in ENGINES:
        ring.add(e, (weights or {}).get(e, 1.0))
    return [ring.owner(k) for k in keys]


def test_hash_is_stable_across_processes() -> None:
    # A pinned value: Python's salted hash() would differ between gateway processes.
    assert stable_hash("rollout-1") == 15705201290008733538


def test_sticky_while_not_overloaded() -> None:
    r = router()
    loads = {e: 3 for e in ENGINES}  # evenly busy: every engine is under its bound
    for key in KEYS[:200]:
        home = r.ring.owner(key)
        assert r.route(key, loads) == home
        assert r.route(key, {}) == home


def test_deterministic_whatever_the_insertion_order() -> None:
    a, b = router(ENGINES), router(list(reversed(ENGINES)))
    loads = {e: i for i, e in enumerate(ENGINES)}
    assert [a.route(k, loads) for k in KEYS[:500]] == [b.route(k, loads) for k in KEYS[:500]]


def test_keys_spread_evenly() -> None:
    counts = Counter(ring_owners(KEYS))
    share = len(KEYS) / len(ENGINES)
    assert set(counts) == set(ENGINES)
    assert all(0.6 * share < c < 1.4 * share for c in counts.values()), counts


def test_capacity_weights_the_share() -> None:
    counts = Counter(ring_owners(KEYS, {"engine-0": 2.0}))
    others = (len(KEYS) - counts["engine-0"]) / (len(ENGINES) - 1)
    assert 1.5 < counts["engine-0"] / others < 2.5


def test_removal_moves_only_the_removed_engines_keys() -> None:
    r = router()
    before = {k: r.ring.owner(k) for k in KEYS}
    r.remove("engine-3")
    after = {k: r.ring.owner(k) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(before[k] == "engine-3" for k in moved)
    assert len(moved) == sum(1 for k in KEYS if before[k] == "engine-3")
    assert 0.5 / len(ENGINES) < len(moved) / len(KEYS) < 1.5 / len(ENGINES)


def test_addition_moves_keys_only_to_the_new_engine() -> None:
    r = router()
    before = {k: r.ring.owner(k) for k in KEYS}
    r.add("engine-new")
    moved = [k for k in KEYS if r.ring.owner(k) != before[k]]
    assert all(r.ring.owner(k) == "engine-new" for k in moved)
    assert 0.5 / 9 < len(moved) / len(KEYS) < 1.5 / 9


@pytest.mark.parametrize("eps", [0.0, 0.25, 1.0])
def test_bounded_load_under_skewed_keys(eps: float) -> None:
    r = router(load_factor=eps)
    rng = random.Random(0)
    hot = KEYS[:3]  # three rollouts send most of the traffic
    loads, homes_of_hot = Counter(), set()
    for step in range(3000):
        key = rng.choice(hot) if rng.random() < 0.8 else rng.choice(KEYS)
        bound = math.ceil((1 + eps) * (sum(loads.values()) + 1) / len(ENGINES))
        engine = r.route(key, loads)
        loads[engine] += 1
        homes_of_hot |= {engine} if key == hot[0] else set()
        assert loads[engine] <= bound, (step, engine, loads[engine], bound)
        if rng.random() < 0.45:  # requests finish too
            done = rng.choice([e for e in loads if loads[e]])
            loads[done] -= 1
    assert len(homes_of_hot) > 1  # the hottest key spilled instead of swamping its home


def test_overloaded_home_spills_clockwise_and_comes_back() -> None:
    r = router(load_factor=0.0)
    key = KEYS[0]
    walk = list(r.ring.walk(key))
    loads = {walk[0]: 10}
    assert r.route(key, loads) == walk[1]
    loads[walk[1]] = 10
    assert r.route(key, loads) == walk[2]
    assert r.route(key, {}) == walk[0]  # once the load drains, the key is home again


def test_weighted_bounds() -> None:
    r = router(["big", "small"], load_factor=0.0)
    r.add("big", 3.0)
    assert r.bounds({"big": 5, "small": 2}) == {"big": math.ceil(8 * 3 / 4), "small": math.ceil(8 / 4)}


def test_exclude_for_retries() -> None:
    r = router(load_factor=0.0)
    key = KEYS[0]
    walk = list(r.ring.walk(key))
    assert r.route(key, {}, exclude={walk[0]}) == walk[1]
    # The excluded engine holds all the spare room: every candidate is over its bound, and the least
    # loaded one still gets the request (nothing waits forever).
    loads = {e: 50 for e in ENGINES} | {walk[0]: 0, walk[5]: 49}
    assert all(loads[e] >= b for e, b in r.bounds(loads).items() if e != walk[0])
    assert r.route(key, loads, exclude={walk[0]}) == walk[5]
    with pytest.raises(NoEngineError, match="excluded"):
        r.route(key, {}, exclude=set(ENGINES))


def test_empty_router_and_bad_arguments() -> None:
    with pytest.raises(NoEngineError, match="no engine"):
        Router().route("k", {})
    with pytest.raises(ValueError):
        Router(load_factor=-0.1)
    with pytest.raises(ValueError):
        HashRing(vnodes=0)
    with pytest.raises(ValueError):
        HashRing().add("e", 0)
    ring = HashRing()
    ring.remove("never-added")  # harmless
    assert ring.owner("k") is None and list(ring.walk("k")) == []


def test_a_ring_changed_one_node_at_a_time_is_the_ring_built_at_once() -> None:
    ring = HashRing()
    for e in ENGINES:
        ring.add(e)
    ring.add("engine-3", 2.5)  # re-weighted
    ring.remove("engine-5")
    ring.add("engine-5", 0.5)
    fresh = HashRing()
    for e, weight in sorted({**dict.fromkeys(ENGINES, 1.0), "engine-3": 2.5, "engine-5": 0.5}.items()):
        fresh.add(e, weight)
    assert ring._points == fresh._points
    assert [ring.owner(k) for k in KEYS[:500]] == [fresh.owner(k) for k in KEYS[:500]]


def test_a_weight_that_would_flood_the_ring_is_refused_before_any_work() -> None:
    ring = HashRing(vnodes=128)
    ring.add("small")
    with pytest.raises(ValueError, match=f"at most {MAX_POINTS_PER_NODE}"):
        ring.add("huge", 1_000_000.0)  # 128 million points: what a registration of capacity 1e6 once built
    assert ring.nodes == {"small": 1.0}
