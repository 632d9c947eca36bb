"""Group routing (issue 36): the gateway places a rollout's calls on the engines' ring by its GRPO group id, so
every member of a group reaches the engine that holds the group's prompt; rollouts without a group, and
evaluation rollouts, by their own id. Bounded loads still apply: a group whose members all run at once fills
its home engine to the bound and the rest spill to the next engine. Through a real gateway over loopback in
front of four engines."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import httpx
from gateway_helpers import KVEngine, LiveGateway, make_service

from asyncrl.gateway.engines import LocalEngine
from asyncrl.gateway.store import open_store

ENGINES = [f"e{i}" for i in range(4)]
GROUP_SIZE = 8
WAIT_S = 60.0


def _gateway(tmp_path, gate: threading.Event | None = None) -> tuple[LiveGateway, dict[str, KVEngine]]:
    engines = {engine_id: KVEngine(engine_id, gate=gate) for engine_id in ENGINES}
    service = make_service(open_store(tmp_path / "run.db"), [LocalEngine(engine) for engine in engines.values()])
    return LiveGateway(service), engines


def _call(gateway: LiveGateway, key: str) -> str:
    """One /v1/tokens/generate call on the rollout of `key`; the engine that answered it."""
    response = gateway.http.post("/v1/tokens/generate", json={"prompt_token_ids": [5, 6, 7]}, headers={"Authorization": f"Bearer {key}"})
    response.raise_for_status()
    return response.json()["engine_id"]


def _home(gateway: LiveGateway, key: str) -> str:
    """The engine the ring gives `key` when no engine is loaded."""
    return gateway.on_loop(lambda: gateway.service.pool.router.route(key, {}))


def test_every_member_of_a_group_reaches_one_engine_and_groups_spread_over_the_engines(tmp_path) -> None:
    live, engines = _gateway(tmp_path)
    with live as gateway:
        served: dict[str, set[str]] = {}
        rollouts: dict[str, str] = {}
        for g in range(8):
            group = f"group-{g}"
            for _ in range(GROUP_SIZE):
                rollout_id, key = gateway.open(group_id=group)
                rollouts[rollout_id] = group
                served.setdefault(group, set()).update({_call(gateway, key), _call(gateway, key)})  # two turns each
        assert all(engines_of_group == {_home(gateway, group)} for group, engines_of_group in served.items())
        assert len({engine for engines_of_group in served.values() for engine in engines_of_group}) > 1
    # Each engine still saw its requests as the rollouts' own sessions (its retained KV is per rollout).
    sessions = Counter(session for engine in engines.values() for session in engine.sessions)
    assert sessions == dict.fromkeys(rollouts, 2)


def test_rollouts_without_a_group_and_evaluation_rollouts_route_by_their_own_id(tmp_path) -> None:
    live, _ = _gateway(tmp_path)
    with live as gateway:
        for _ in range(6):
            rollout_id, key = gateway.open(group_id="")
            assert _call(gateway, key) == _home(gateway, rollout_id)
        # Held-out problems share one group label ("eval"): routed by it, they would all meet on one engine.
        for _ in range(6):
            opened = gateway.http.post("/rollouts", json={"task": "t", "group_id": "eval", "evaluation": True}).json()
            assert gateway.service.rollouts.live[opened["rollout_id"]].route_key == opened["rollout_id"]
            assert _call(gateway, opened["api_key"]) == _home(gateway, opened["rollout_id"])


def test_a_group_whose_members_run_at_once_spills_past_its_loaded_home_to_the_next_engine(tmp_path) -> None:
    gate = threading.Event()
    live, engines = _gateway(tmp_path, gate)
    with live as gateway:
        keys = [gateway.open(group_id="crowd")[1] for _ in range(GROUP_SIZE)]

        async def all_at_once() -> list[str]:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=WAIT_S) as client:
                body = {"prompt_token_ids": [5, 6, 7]}
                calls = [
                    asyncio.create_task(client.post("/v1/tokens/generate", json=body, headers={"Authorization": f"Bearer {key}"}))
                    for key in keys
                ]
                deadline = time.monotonic() + WAIT_S  # a hang guard, not part of the verdict
                while sum(engine.waiting for engine in engines.values()) < GROUP_SIZE:
                    assert time.monotonic() < deadline, "the group's calls never all reached the engines"
                    await asyncio.sleep(0.01)
                gate.set()
                return [(await call).json()["engine_id"] for call in calls]

        served = Counter(asyncio.run(all_at_once()))
        walk = gateway.on_loop(lambda: list(gateway.service.pool.router.ring.walk("crowd")))
    # With 4 idle engines and load factor 0.25, the k-th call in flight may join an engine holding fewer than
    # ceil(1.25 * k / 4) calls: the home takes calls 1, 4 and 7, the next engines clockwise the others.
    assert served == {walk[0]: 3, walk[1]: 3, walk[2]: 2}


def test_a_rollout_a_gateway_finds_in_the_store_routes_by_the_group_the_store_recorded(tmp_path) -> None:
    live, _ = _gateway(tmp_path)
    with live as gateway:
        home = _home(gateway, "group-3")
        rollout_id, key = gateway.open(group_id="group-3")
        while _home(gateway, rollout_id) == home:  # one whose own id would route elsewhere, so the verdict tells
            rollout_id, key = gateway.open(group_id="group-3")
        gateway.on_loop(gateway.service.rollouts.live.pop, rollout_id)  # as after a restart: only the store knows it
        assert _call(gateway, key) == home
        assert gateway.service.rollouts.live[rollout_id].group_id == "group-3"
