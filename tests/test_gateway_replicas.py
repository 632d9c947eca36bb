"""Gateway replicas (gateway/replicas.py): two real gateways over loopback sharing one Redis store, each
in front of an engine of its own. A rollout is served by the replica that opened it whichever replica
the agent calls: its turns stay on one branch, token-exact, on its home's engine; lifecycle calls act
at the home; a home that died leaves its rollouts to whichever replica their calls reach."""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time
import uuid

import httpx
import openai
import pytest
from conftest import REDIS_URL, redis_or_skip
from gateway_helpers import TOKENIZER, TOOLS, EngineServer, LiveGateway, Replier, live_engines, make_engine

from asyncrl.configs import ConfigError
from asyncrl.configs.loader import load_config
from asyncrl.configs.schema import GatewayConfig, SamplingConfig
from asyncrl.gateway.engines import Announcement
from asyncrl.gateway.pool import EnginePool
from asyncrl.gateway.replicas import ReplicaSet, home_of, target_rollout
from asyncrl.gateway.routing import Router
from asyncrl.gateway.service import GatewayService
from asyncrl.gateway.store import open_store

WAIT_S = 60.0
"""Longest wait for what a test waits on (a safety valve on a loaded machine, never the verdict)."""


@pytest.fixture(scope="module")
def engines():
    return {"g0": make_engine("engine-of-g0"), "g1": make_engine("engine-of-g1")}


@pytest.fixture
def namespace():
    client = redis_or_skip()
    name = f"test-replicas-{uuid.uuid4().hex}"
    yield name
    keys = list(client.scan_iter(match=f"asyncrl:{name}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def replica(replica_id: str, engine, namespace: str, secret: bytes) -> GatewayService:
    """A gateway replica with its own connection to the shared store and its own engine (None: none yet)."""
    from asyncrl.gateway.engines import LocalEngine

    store = open_store(REDIS_URL, namespace=namespace)
    config = GatewayConfig(replica_id=replica_id, replica_ttl_s=600)  # nothing lapses during a test
    pool = EnginePool(config)
    if engine is not None:
        pool.add_local(LocalEngine(engine) if hasattr(engine, "step") else engine)  # an engine, or a handle already
    replicas = ReplicaSet(store, replica_id, config.replica_ttl_s)
    return GatewayService(store, TOKENIZER, pool, config, SamplingConfig(max_tokens=16), secret=secret, replicas=replicas)


@pytest.fixture
def pair(engines, namespace):
    """(g0, g1): two live replicas that know each other."""
    secret = secrets.token_bytes(32)  # shared: a key or run token of one is valid at the other
    first, second = replica("g0", engines["g0"], namespace, secret), replica("g1", engines["g1"], namespace, secret)
    with LiveGateway(first) as g0, LiveGateway(second) as g1:
        g0.await_on_loop(g0.service.io(g0.service.replicas.announce))  # g0 learns of g1, which started after it
        yield g0, g1


def client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)


def tool_turn(agent: openai.OpenAI, messages: list[dict], **options) -> list[dict]:
    reply = agent.chat.completions.create(model="policy", messages=messages, tools=TOOLS, **options)
    message = reply.choices[0].message
    call = message.tool_calls[0]
    echoed = json.loads(message.model_dump_json(exclude_none=True))
    return [*messages, echoed, {"role": "tool", "tool_call_id": call.id, "content": "42"}]


def test_a_rollout_is_served_by_the_replica_that_opened_it_whichever_replica_the_agent_calls(pair) -> None:
    g0, g1 = pair
    opened = g0.http.post("/rollouts", json={"task": "t", "group_id": "g"}).json()
    rollout_id, key = opened["rollout_id"], opened["api_key"]
    assert home_of(rollout_id) == "g0" and opened["base_url"] == g0.url + "/v1"

    messages = [{"role": "user", "content": "go"}]
    for url in (g0.url, g1.url, g0.url, g1.url):  # an agent behind a load balancer, alternating
        messages = tool_turn(client(url + "/v1", key), messages)

    turns = g0.service.store.get(rollout_id).turns
    assert len(turns) == 4 and {t.branch for t in turns} == {0}  # one conversation: no fork
    assert {t.engine_id for t in turns} == {"engine-of-g0"}  # routed by the home alone
    for earlier, later in itertools.pairwise(turns):
        so_far = earlier.prompt_token_ids + earlier.completion_token_ids
        assert later.prompt_token_ids[: len(so_far)] == so_far  # token-exact across replicas
    assert g1.service.replicas.forwarded == 2 and g0.service.replicas.forwarded == 0


def test_a_stream_through_another_replica_is_relayed_as_its_home_samples_it(pair) -> None:
    g0, g1 = pair
    opened = g1.http.post("/rollouts", json={"task": "t"}).json()
    assert home_of(opened["rollout_id"]) == "g1"
    stream = client(g0.url + "/v1", opened["api_key"]).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "go"}], tools=TOOLS, stream=True
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert g0.service.replicas.forwarded == 1
    (turn,) = g1.service.store.get(opened["rollout_id"]).turns
    assert turn.engine_id == "engine-of-g1" and turn.finish_reason == "stop"


def test_a_caller_leaving_a_relayed_stream_ends_the_turn_at_its_home(engines, namespace) -> None:
    """The relay closes its connection to the home, which aborts the engine request and records the turn
    truncated, as for a caller of its own."""
    secret = secrets.token_bytes(32)
    reply = [*TOKENIZER.encode("Hi, bot!", add_special_tokens=False), TOKENIZER.eos_token_id]
    held = Replier(reply, engine_id="held", hold=3)  # streams three tokens, then waits to be aborted
    first, second = replica("g0", held, namespace, secret), replica("g1", engines["g1"], namespace, secret)
    with LiveGateway(first) as g0, LiveGateway(second) as g1:
        opened = g0.http.post("/rollouts", json={"task": "t"}).json()
        body = {"model": "policy", "messages": [{"role": "user", "content": "go"}], "stream": True}
        as_agent = {"authorization": f"Bearer {opened['api_key']}"}
        with httpx.stream("POST", g1.url + "/v1/chat/completions", json=body, headers=as_agent) as answer:
            assert answer.status_code == 200
            seen = ""
            for text in answer.iter_text():
                seen += text
                if seen.count('"content":') >= 3:  # the three tokens the engine let out
                    break
        assert held.closed.wait(WAIT_S), "the home's engine request was not aborted"
        deadline = time.monotonic() + WAIT_S  # a safety valve: the wait ends on the record
        while not g0.service.store.get(opened["rollout_id"]).turns:
            assert time.monotonic() < deadline, "the truncated turn was never recorded"
            time.sleep(0.02)
        (turn,) = g0.service.store.get(opened["rollout_id"]).turns
        assert turn.finish_reason == "abort" and turn.completion_token_ids == reply[:3] and turn.engine_id == "held"


def test_every_keyed_route_reaches_the_home_through_another_replica(pair) -> None:
    """The Anthropic SDK (its key in x-api-key), text completions, token generation and an evaluation rollout,
    each called at the replica that is not the rollout's home."""
    import anthropic

    g0, g1 = pair
    opened = g0.http.post("/rollouts", json={"task": "t"}).json()
    claude = anthropic.Anthropic(base_url=g1.url, api_key=opened["api_key"], max_retries=0, timeout=60)
    claude.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert claude.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
    agent = client(g1.url + "/v1", opened["api_key"])
    agent.completions.create(model="policy", prompt="1+1=", max_tokens=4)
    as_agent = {"authorization": f"Bearer {opened['api_key']}"}
    generated = httpx.post(g1.url + "/v1/tokens/generate", json={"prompt_token_ids": [5, 6, 7], "max_tokens": 3}, headers=as_agent)
    assert generated.status_code == 200 and generated.json()["engine_id"] == "engine-of-g0"
    assert [t.engine_id for t in g0.service.store.get(opened["rollout_id"]).turns] == ["engine-of-g0"] * 3
    assert g1.service.replicas.forwarded == 4

    evaluation = g0.http.post("/rollouts", json={"task": "t", "evaluation": True}).json()  # in g0's memory only
    reply = client(g1.url + "/v1", evaluation["api_key"]).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "go"}], max_tokens=4
    )
    assert reply.model_extra["asyncrl"]["evaluation"] is True and reply.model_extra["asyncrl"]["engine_id"] == "engine-of-g0"


def test_keys_that_are_not_a_rollouts_are_refused_wherever_they_land(pair) -> None:
    _, g1 = pair  # forged keys naming g0 are forwarded there and refused by it
    for key in ("rk-0123~g0.forged", "rk-0123~nobody.forged", "rk-.~g0", "sk-something-else"):
        answer = httpx.post(
            g1.url + "/v1/chat/completions", json={"model": "p", "messages": [{"role": "user", "content": "go"}]},
            headers={"authorization": f"Bearer {key}"},
        )  # fmt: skip
        assert answer.status_code == 401, (key, answer.text)
    assert httpx.post(g1.url + "/rollouts/0123~g0/finish", json={"reward": 1.0}).status_code == 401  # no run token


def test_lifecycle_calls_on_any_replica_act_at_the_rollouts_home(pair) -> None:
    g0, g1 = pair
    rollout_id = g0.http.post("/rollouts", json={"task": "t"}).json()["rollout_id"]
    assert rollout_id in g0.service.rollouts.live
    info = g1.http.get(f"/rollouts/{rollout_id}")
    assert info.status_code == 200 and info.json()["status"] == "running"
    finished = g1.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": 1.0})
    assert finished.status_code == 200 and finished.json()["status"] == "ok"
    assert rollout_id not in g0.service.rollouts.live  # the home ended it, so it wakes what it held
    assert g0.service.rollouts.ended[rollout_id] == "ok"
    assert g1.service.replicas.forwarded == 2
    # A refusal at the home comes back as the home answered it.
    again = g1.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": 1.0})
    assert again.status_code == 409 and again.json()["error"]["code"] == "rollout_closed"


def test_a_dead_homes_rollouts_are_served_by_the_replica_their_calls_reach(engines, namespace) -> None:
    secret = secrets.token_bytes(32)
    with LiveGateway(replica("g1", engines["g1"], namespace, secret)) as g1:
        with LiveGateway(replica("g0", engines["g0"], namespace, secret)) as g0:
            opened = g0.http.post("/rollouts", json={"task": "t"}).json()
            messages = tool_turn(client(g0.url + "/v1", opened["api_key"]), [{"role": "user", "content": "go"}])
            g1.await_on_loop(g1.service.io(g1.service.replicas.announce))
            assert "g0" in g1.service.replicas.peers
        # g0 is gone; g1 still lists it (its announcement would lapse after the ttl), and its connection is refused.
        tool_turn(client(g1.url + "/v1", opened["api_key"]), messages)
        assert g1.service.replicas.forwarded == 0
        assert g1.http.post(f"/rollouts/{opened['rollout_id']}/finish", json={"reward": 0.0}).status_code == 200
        trajectory = g1.service.store.get(opened["rollout_id"])
        assert trajectory.status == "ok"
        assert [t.engine_id for t in trajectory.turns] == ["engine-of-g0", "engine-of-g1"]  # nothing recorded is lost


def test_an_engine_that_announces_itself_to_one_replica_serves_them_all(namespace) -> None:
    """An engine on another machine (`engine_app` over HTTP) runs its `Announcement` against one replica; it
    learns the others from it and registers and heartbeats with each, so each routes its rollouts there."""
    secret = secrets.token_bytes(32)
    remote = make_engine("remote-0")
    first, second = replica("g0", None, namespace, secret), replica("g1", None, namespace, secret)
    try:
        with EngineServer(remote) as address, LiveGateway(first) as g0, LiveGateway(second) as g1:
            g0.await_on_loop(g0.service.io(g0.service.replicas.announce))

            async def announce_then_leave() -> None:
                announcement = Announcement(g0.url, "remote-0", address, token=g0.engine_token, health=remote.health, interval_s=0.05)
                beating = asyncio.create_task(announcement.run())
                deadline = time.monotonic() + 60  # a safety valve: the wait ends on the registries
                while not (live_engines(g0) == live_engines(g1) == {"remote-0"}):
                    assert time.monotonic() < deadline, "the engine never reached both replicas"
                    await asyncio.sleep(0.05)
                served = await asyncio.to_thread(served_at, g1)
                beating.cancel()
                await asyncio.gather(beating, return_exceptions=True)
                await announcement.deregister()
                await announcement.aclose()
                return served

            assert asyncio.run(announce_then_leave()) == "remote-0"
            assert live_engines(g0) == live_engines(g1) == set()  # it left both
    finally:
        remote.shutdown()


def served_at(gateway: LiveGateway) -> str:
    opened = gateway.http.post("/rollouts", json={"task": "t"}).json()
    reply = client(gateway.url + "/v1", opened["api_key"]).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "go"}], max_tokens=4
    )
    return reply.model_extra["asyncrl"]["engine_id"]


def test_a_replica_id_a_live_gateway_holds_is_refused(engines, namespace) -> None:
    secret = secrets.token_bytes(32)
    taken = replica("g0", engines["g0"], namespace, secret)
    twin = replica("g0", engines["g1"], namespace, secret)
    with LiveGateway(taken), pytest.raises(ValueError, match=r"'g0' is already announced"), LiveGateway(twin):
        pass


def test_a_runs_own_replica_takes_over_the_id_a_dead_process_left_announced(namespace) -> None:
    """A run resumed right after a crash starts its replicas under the same ids while the dead ones' announcements
    are still live: the run's own replica sets take the ids over; a user's (exclusive) are refused."""
    store = open_store(REDIS_URL, namespace=namespace)
    try:
        store.announce_replica("g1", "http://127.0.0.1:1", ttl_s=600)  # the crashed process's, never withdrawn

        async def start(exclusive: bool) -> None:
            await ReplicaSet(store, "g1", 600, exclusive=exclusive).start("http://127.0.0.1:2", io=asyncio.to_thread)

        with pytest.raises(ValueError, match="replica_ttl_s"):
            asyncio.run(start(exclusive=True))
        asyncio.run(start(exclusive=False))
        assert store.replicas() == {"g1": "http://127.0.0.1:2"}
    finally:
        store.close()


def test_every_replica_routes_a_rollout_to_the_same_engine() -> None:
    # Engines joined in different orders (as replicas hear of them) still make one ring.
    first, second = Router(), Router()
    for engine in ["e0", "e1", "e2", "e3"]:
        first.add(engine)
    for engine in ["e3", "e1", "e0", "e2"]:
        second.add(engine)
    keys = [f"{uuid.uuid4().hex}~g{i % 3}" for i in range(500)]
    routed = [first.route(key, {}) for key in keys]
    assert routed == [second.route(key, {}) for key in keys]
    assert len(set(routed)) == 4


@pytest.mark.parametrize(
    ("path", "headers", "rollout"),
    [
        ("/v1/chat/completions", {b"authorization": b"Bearer rk-abc~g1.0123"}, "abc~g1"),
        ("/v1/messages", {b"x-api-key": b"rk-abc~g2.0123"}, "abc~g2"),
        ("/v1/tokens/generate", {b"authorization": b"Bearer rk-abc.0123"}, "abc"),
        ("/rollouts/abc~g1/finish", {}, "abc~g1"),
        ("/rollouts/abc~g1", {}, "abc~g1"),
        ("/v1/chat/completions", {b"authorization": b"Bearer sk-not-a-rollout-key"}, None),
        ("/v1/models", {b"authorization": b"Bearer rk-abc~g1.0123"}, None),
        ("/rollouts", {}, None),
    ],
)
def test_the_rollout_a_call_is_about_is_read_from_its_path_or_key(path, headers, rollout) -> None:
    assert target_rollout({"path": path, "headers": list(headers.items())}) == rollout


def test_a_bad_replica_id_is_refused_naming_the_key(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"gateway\.replica_id"):
        load_config(None, ["gateway.replica_id=a~b"])
