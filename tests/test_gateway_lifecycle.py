"""Rollout lifecycle over HTTP: open, finish, abort, describe, the refusals that protect records, and
evaluation rollouts (greedy, recorded nowhere)."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from gateway_helpers import TOOLS, LiveGateway, Pausable, make_engine, make_service

from asyncrl.gateway.client import GatewayClient, GatewayRefused
from asyncrl.gateway.engines import LocalEngine
from asyncrl.gateway.store import open_store
from asyncrl.lifecycle import LifecycleRefused

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine():
    engine = make_engine("e0")
    yield engine
    engine.shutdown()


@pytest.fixture
def gateway(engine, tmp_path):
    with LiveGateway(make_service(open_store(tmp_path), [engine])) as gw:
        yield gw


def _refused(client, status: int, fragment: str) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="policy", messages=USER)
    assert caught.value.status_code == status
    assert fragment in caught.value.message, caught.value.message
    assert caught.value.response.headers["x-should-retry"] == "false"


def test_client_library_round_trip(gateway) -> None:
    with GatewayClient(gateway.url, token=gateway.run_token) as client:
        rollout = client.open_rollout(task="t", group_id="g", metadata={"seed": 3})
        assert rollout.base_url == gateway.url + "/v1"
        reply = rollout.openai(max_retries=0).chat.completions.create(model="policy", messages=USER)
        assert reply.choices[0].message.tool_calls
        info = client.finish(rollout.rollout_id, reward=1.0, status="env_crash", metrics={"tool_calls": 1})
        assert (info["status"], info["reward"], info["turns"], info["metrics"]) == ("env_crash", 1.0, 1, {"tool_calls": 1})
        assert client.get(rollout.rollout_id)["metadata"] == {"seed": 3}


def test_unknown_finished_and_aborted_keys_are_refused(gateway) -> None:
    _refused(gateway.openai("not-a-key"), 401, "unknown rollout key")
    rollout_id, key = gateway.open()
    _refused(gateway.openai(key[:-1] + ("0" if key[-1] != "0" else "1")), 401, "unknown rollout key")
    gateway.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": 1.0}).raise_for_status()
    _refused(gateway.openai(key), 409, "is ok")

    rollout_id, key = gateway.open()
    assert gateway.http.post(f"/rollouts/{rollout_id}/abort", json={"reason": "env gave up"}).json()["status"] == "aborted"
    _refused(gateway.openai(key), 409, "is aborted")
    tokens = gateway.http.post("/v1/tokens/generate", json={"prompt_token_ids": [4]}, headers={"Authorization": f"Bearer {key}"})
    assert tokens.status_code == 409

    missing = httpx.post(gateway.url + "/v1/chat/completions", json={"messages": USER})  # no credentials at all
    assert missing.status_code == 401 and "Authorization: Bearer" in missing.json()["error"]["message"]


def test_lifecycle_refusals(gateway) -> None:
    rollout_id, _ = gateway.open()
    bad = gateway.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": 1.0, "status": "aborted"})
    assert bad.status_code == 400 and "status" in bad.json()["error"]["message"]
    assert gateway.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": "nan"}).status_code == 400
    assert gateway.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": 0.0}).status_code == 200
    again = gateway.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": 0.0})
    assert again.status_code == 409 and "cannot finish" in again.json()["error"]["message"]
    assert gateway.http.post(f"/rollouts/{rollout_id}/abort").status_code == 409
    unknown = gateway.http.post("/rollouts/nope/finish", json={"reward": 1.0})
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]["message"]
    assert gateway.http.get("/rollouts/nope").status_code == 404


def test_abort_ends_a_request_in_flight(engine, tmp_path) -> None:
    paused = Pausable(engine)
    with LiveGateway(make_service(open_store(tmp_path), [paused])) as gw:
        rollout_id, key = gw.open()
        paused.pause()
        errors = []
        call = threading.Thread(target=lambda: _capture(errors, gw.openai(key)))
        call.start()
        assert paused.started.wait(10)
        assert gw.http.get(f"/rollouts/{rollout_id}").json()["in_flight"] == 1
        gw.http.post(f"/rollouts/{rollout_id}/abort", json={"reason": "test"}).raise_for_status()
        call.join(10)
        (error,) = errors
        assert error.status_code == 409 and "aborted while this request was running" in error.message
        assert gw.service.store.get(rollout_id).turns == []


def _capture(errors: list, client) -> None:
    try:
        client.chat.completions.create(model="policy", messages=USER)
    except openai.APIStatusError as error:
        errors.append(error)


class Recording(LocalEngine):
    """A real in-process engine that keeps the sampling options of every request it is sent."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.sampling: list = []

    async def generate(self, prompt_token_ids, sampling, session_id):
        self.sampling.append(sampling)
        return await super().generate(prompt_token_ids, sampling, session_id)


def test_an_evaluation_rollout_is_sampled_greedily_and_recorded_nowhere(engine, tmp_path) -> None:
    recording, store = Recording(engine), open_store(tmp_path)
    # Overrides allowed, so that the recorded rollout below keeps the temperature it asks for.
    service = make_service(store, [recording], sampling_overrides="allow")
    with LiveGateway(service) as gw, GatewayClient(gw.url, token=gw.run_token) as client:
        empty = store.counts()
        rollout = client.open_rollout(task="t", group_id="g", metadata={"seed": 3}, evaluation=True)
        agent = rollout.openai(max_retries=0)
        reply = agent.chat.completions.create(model="policy", messages=USER, tools=TOOLS, temperature=1.7, top_p=0.5)
        assert reply.choices[0].message.tool_calls[0].function.name == "f"
        assert reply.model_extra["asyncrl"]["evaluation"] is True and reply.model_extra["asyncrl"]["turn_index"] == 0
        text = agent.completions.create(model="policy", prompt="<|user|>hi<|assistant|>", temperature=2.0, max_tokens=4)
        assert (text.model_extra["asyncrl"]["evaluation"], text.model_extra["asyncrl"]["turn_index"]) == (True, 1)
        # Greedy whatever the episode asked; the other options are the request's.
        assert [(s.temperature, s.top_p, s.max_tokens) for s in recording.sampling] == [(0.0, 0.5, 16), (0.0, 1.0, 4)]
        info = client.get(rollout.rollout_id)
        assert (info["status"], info["turns"], info["task"], info["group_id"], info["metadata"]) == ("running", 2, "t", "g", {"seed": 3})

        finished = client.finish(rollout.rollout_id, reward=1.0, metrics={"correct": True})
        assert (finished["status"], finished["reward"], finished["turns"], finished["metrics"]) == ("ok", 1.0, 2, {"correct": True})
        assert store.list() == [] and store.counts() == empty
        with pytest.raises(GatewayRefused) as dropped:
            client.get(rollout.rollout_id)
        assert dropped.value.status == 404
        _refused(agent, 409, "is ok")

        aborted = client.open_rollout(task="t", evaluation=True)
        assert client.abort(aborted.rollout_id, reason="stopped")["status"] == "aborted"
        _refused(aborted.openai(max_retries=0), 409, "is aborted")
        assert store.list() == [] and gw.service.health()["rollouts_running"] == 0

        # The same request in a recorded rollout keeps its temperature and is recorded.
        recorded = client.open_rollout(task="t")
        plain = recorded.openai(max_retries=0).chat.completions.create(model="policy", messages=USER, temperature=1.7)
        assert "evaluation" not in plain.model_extra["asyncrl"] and recording.sampling[-1].temperature == 1.7
        assert [t.rollout_id for t in store.list()] == [recorded.rollout_id]


def test_the_in_process_lifecycle_finishes_as_the_route_does_without_reading_the_rollout_back(gateway, monkeypatch) -> None:
    """The runner never reads what `finish` returns, so the in-process lifecycle does not read the whole
    trajectory back from the store for it: the rollout ends the same, with one store read fewer."""
    from asyncrl.gateway.lifecycle import InProcessLifecycle

    lifecycle = InProcessLifecycle(gateway.service, gateway.url)
    store, reads = gateway.service.store, []
    original_get = store.get
    monkeypatch.setattr(store, "get", lambda rollout_id: reads.append(rollout_id) or original_get(rollout_id))
    rollout = gateway.await_on_loop(lifecycle.open_rollout(task="t", group_id="g"))
    gateway.openai(rollout.api_key).chat.completions.create(model="policy", messages=USER)
    assert gateway.await_on_loop(lifecycle.finish(rollout.rollout_id, 0.5, metrics={"correct": False})) is None
    assert reads == []
    assert gateway.http.get(f"/rollouts/{rollout.rollout_id}").json()["status"] == "ok"
    stored = original_get(rollout.rollout_id)
    assert (stored.status, stored.reward, stored.metrics, len(stored.turns)) == ("ok", 0.5, {"correct": False}, 1)
    with pytest.raises(LifecycleRefused) as refused:  # finished: a second finish is refused as over HTTP
        gateway.await_on_loop(lifecycle.finish(rollout.rollout_id, 1.0))
    assert refused.value.status == 409
