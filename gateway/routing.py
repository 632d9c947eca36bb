"""Which engine serves a rollout: consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

The key is the rollout's GRPO group id (`Rollout.route_key`, gateway/rollouts.py), or its own id when it
has no group (evaluation rollouts, agents served by hand). Every turn of a rollout should reach the same
engine, whose KV cache still holds the earlier turns, and every member of a group the engine that holds
the group's prompt, so that the prompt is prefilled once for the group rather than once per member
(prefix reuse). A hash ring gives that stickiness, and adding or removing an engine moves only the
keys next to it (about 1/N of them). Plain consistent hashing lets a few hot keys swamp one engine (a
group is a hot key: its members arrive together), so an engine whose in-flight load has reached
ceil((1 + eps) * average) is skipped and the walk goes on clockwise to the next engine. The bound is
counted with the new request included, so some engine is always under it; a key only leaves its home
engine while that engine is overloaded, and a group's members spill to the next engine only then.

Engines may have unequal capacities: an engine's share of the ring (virtual nodes) and its load
bound both scale with its capacity. Changing one engine hashes only that engine's points, and no
engine gets more than MAX_POINTS_PER_NODE, so a change costs bounded work on the event loop.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Collection, Iterable, Iterator, Mapping
from hashlib import blake2b
from typing import Any

MAX_POINTS_PER_NODE = 1 << 18
"""Most ring points of one node: gateway.route_vnodes (at most 4096) times the largest capacity (64)."""


class NoEngineError(LookupError):
    """No engine can take the request (none registered, or all excluded)."""


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process (Python's hash() is salted per process)."""
    return int.from_bytes(blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Nodes placed on a 64-bit ring at `vnodes * weight` points each."""

    def __init__(self, vnodes: int = 128) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be at least 1")
        self.vnodes = vnodes
        self._weights: dict[str, float] = {}
        self._points: list[tuple[int, str]] = []
        self._hashes: list[int] = []

    def add(self, node: str, weight: float = 1.0) -> None:
        """Add a node, or change its weight."""
        if not weight > 0:
            raise ValueError(f"weight of {node!r} must be positive, got {weight}")
        points = max(1, round(self.vnodes * weight))
        if points > MAX_POINTS_PER_NODE:
            raise ValueError(f"weight {weight} of {node!r} would put {points} points on the ring; at most {MAX_POINTS_PER_NODE}")
        if self._weights.get(node) == weight:
            return  # heartbeats re-announce engines; do not rebuild the ring for nothing
        if node in self._weights:
            self._drop(node)
        self._weights[node] = weight
        # Points depend only on (node, index), never on insertion order, so every gateway agrees.
        # Two sorted runs: the sort merges them in linear time, and no other node is hashed again.
        self._points = sorted(self._points + sorted((stable_hash(f"{node}#{i}"), node) for i in range(points)))
        self._hashes = [h for h, _ in self._points]

    def remove(self, node: str) -> None:
        if node in self._weights:
            self._drop(node)
            del self._weights[node]
            self._hashes = [h for h, _ in self._points]

    def _drop(self, node: str) -> None:
        self._points = [point for point in self._points if point[1] != node]

    @property
    def nodes(self) -> dict[str, float]:
        """node -> weight."""
        return dict(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def __contains__(self, node: object) -> bool:
        return node in self._weights

    def walk(self, key: str) -> Iterator[str]:
        """Every node once, in ring order starting at the key's position."""
        if not self._points:
            return
        seen: set[str] = set()
        start = bisect_right(self._hashes, stable_hash(key))
        for i in range(len(self._points)):
            node = self._points[(start + i) % len(self._points)][1]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self._weights):
                    return

    def owner(self, key: str) -> str | None:
        """The key's home node (None on an empty ring)."""
        return next(self.walk(key), None)


class Router:
    """Routing key (a group or rollout id) -> engine id, given the engines' in-flight loads at the moment of the call.

    `load_factor` is eps: 0 balances tightly (keys move as soon as an engine is above average),
    larger values keep more keys at home (and let the busiest engine run further above average).
    """

    def __init__(self, *, vnodes: int = 128, load_factor: float = 0.25) -> None:
        if not load_factor >= 0:
            raise ValueError(f"load_factor must be >= 0, got {load_factor}")
        self.ring = HashRing(vnodes)
        self.load_factor = load_factor

    def add(self, engine_id: str, capacity: float = 1.0) -> None:
        self.ring.add(engine_id, capacity)

    def remove(self, engine_id: str) -> None:
        self.ring.remove(engine_id)

    def apply(self, event: Any) -> None:
        """Follow a `registry.RegistryEvent`, so the ring holds exactly the live engines:
        `registry.subscribe(router.apply)`."""
        if event.kind == "registered":
            self.add(event.engine.id, event.engine.capacity)
        else:
            self.remove(event.engine.id)

    @property
    def engines(self) -> list[str]:
        return sorted(self.ring.nodes)

    def bounds(self, loads: Mapping[str, int]) -> dict[str, int]:
        """Per engine: the in-flight count at which it stops taking new keys, for the next request."""
        weights = self.ring.nodes
        total = sum(loads.get(e, 0) for e in weights) + 1  # the request being placed counts
        scale = (1 + self.load_factor) * total / sum(weights.values())
        return {e: math.ceil(scale * w) for e, w in weights.items()}

    def route(self, key: str, loads: Mapping[str, int], exclude: Collection[str] = ()) -> str:
        """The first engine clockwise from `key` that is under its bound and not excluded.

        `exclude` is for retries after an engine failed. Excluded engines may hold the spare room the
        bound guarantees; then the least loaded candidate (relative to capacity) is chosen instead.
        """
        candidates = self._candidates(self.ring.walk(key), exclude)
        bounds = self.bounds(loads)
        for engine in candidates:
            if loads.get(engine, 0) < bounds[engine]:
                return engine
        return self._least_loaded(candidates, loads)

    def least_loaded(self, loads: Mapping[str, int], exclude: Collection[str] = ()) -> str:
        """The engine with the fewest requests in flight relative to its capacity, for calls that have
        no key to keep at home (scoring); ties go to the first engine id."""
        return self._least_loaded(self._candidates(self.engines, exclude), loads)

    def _candidates(self, engines: Iterable[str], exclude: Collection[str]) -> list[str]:
        candidates = [e for e in engines if e not in exclude]
        if not candidates:
            raise NoEngineError("no engine is registered" if not len(self.ring) else "every engine is excluded")
        return candidates

    def _least_loaded(self, candidates: list[str], loads: Mapping[str, int]) -> str:
        weights = self.ring.nodes
        return min(candidates, key=lambda e: loads.get(e, 0) / weights[e])
