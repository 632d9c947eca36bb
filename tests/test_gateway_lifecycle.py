"""Rollout lifecycle over HTTP: open, finish, abort, describe, and the refusals that protect records."""

from __future__ import annotations

import threading

import openai
import pytest
from gateway_helpers import LiveGateway, Pausable, make_engine, make_service

from asyncrl.gateway.client import GatewayClient
from asyncrl.gateway.store import open_store

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
    with GatewayClient(gateway.url) as client:
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

    missing = gateway.http.post("/v1/chat/completions", json={"messages": USER})
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
