"""Engines that die, hang or live elsewhere: retries from the recorded prompt tokens, fail-fast,
deadlines, heartbeat expiry, and remote engines that register over HTTP.

Heartbeats are asked for often (every 0.05 s) and their window (0.4 s) runs on a ManualClock: an engine
expires when the test moves the clock past its window, never because a busy machine was slow to heartbeat.
"""

from __future__ import annotations

import itertools
import threading
import time

import openai
import pytest
from gateway_helpers import TOOLS, EngineServer, LiveGateway, ManualClock, Pausable, make_engine, make_service

from asyncrl.gateway.store import open_store

USER = [{"role": "user", "content": "hi"}]
FAST_HEARTBEATS = dict(heartbeat_interval_s=0.05, heartbeat_timeout_s=0.4)


@pytest.fixture(scope="module")
def engines():
    engines = [make_engine(f"e{i}") for i in range(2)]
    yield engines
    for engine in engines:
        engine.shutdown()


def _home(gw: LiveGateway, rollout_id: str) -> str:
    """The engine a running rollout's calls go to while no engine is loaded (routed by its group: gateway/routing.py)."""
    return gw.on_loop(lambda: gw.service.pool.router.route(gw.service.rollouts.live[rollout_id].route_key, {}))


def _live_engines(gw: LiveGateway) -> set[str]:
    return {e["engine_id"] for e in gw.http.get("/health").json()["engines"]}


def _call_in_thread(client, results: list) -> threading.Thread:
    def call():
        try:
            results.append(client.chat.completions.create(model="policy", messages=USER, tools=TOOLS))
        except openai.APIStatusError as error:
            results.append(error)

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def _expire_the_silent_one(gw: LiveGateway, clock: ManualClock, silent: str, live: set[str]) -> None:
    """Move the registry's clock on until `silent` has expired, in steps shorter than the heartbeat window,
    each once every engine in `live` has heartbeated at the new time: only a silent engine can expire,
    however long the machine takes to ask for a heartbeat."""
    registry = gw.service.pool.registry
    deadline = time.monotonic() + 120  # a hang guard only
    while True:
        clock.advance(0.75 * FAST_HEARTBEATS["heartbeat_timeout_s"])
        while True:
            beats = gw.on_loop(lambda: {info.id: info.last_heartbeat for info in registry.alive()})
            assert live <= beats.keys(), f"a live engine expired: {beats}"
            if all(beats[engine_id] >= clock.now for engine_id in live):
                break
            assert time.monotonic() < deadline, "the live engines were never heartbeated"
            time.sleep(0.005)
        if silent not in beats:
            return


def _kill_mid_request(gw: LiveGateway, handles: dict[str, Pausable], clock: ManualClock) -> tuple[str, str, object, list]:
    """Kills the home engine of a request it holds; returns the rollout, the dead engine, what the call
    got and every deregistration meanwhile (engine id, reason)."""
    dropped: list[tuple[str, str]] = []
    registry = gw.service.pool.registry
    gw.on_loop(registry.subscribe, lambda event: event.kind == "deregistered" and dropped.append((event.engine.id, event.reason)))
    rollout_id, key = gw.open()
    home = handles[_home(gw, rollout_id)]
    home.pause()
    results: list = []
    thread = _call_in_thread(gw.openai(key), results)
    assert home.started.wait(60)
    home.kill()
    # The request waits on its dead engine for as long as the clock stays: the heartbeat window ends the wait.
    assert thread.is_alive() and results == []
    _expire_the_silent_one(gw, clock, home.engine_id, set(handles) - {home.engine_id})
    thread.join(120)  # a hang guard, far below the request deadline (request_timeout_s, 300 s)
    assert not thread.is_alive(), "the request outlived its engine's expiry"
    return rollout_id, home.engine_id, results[0], dropped


def test_a_request_on_a_killed_engine_is_retried_on_another(engines, tmp_path) -> None:
    handles = {e.engine_id: Pausable(e) for e in engines}
    clock = ManualClock()
    service = make_service(open_store(tmp_path), list(handles.values()), clock=clock, engine_retries=1, **FAST_HEARTBEATS)
    with LiveGateway(service) as gw:
        rollout_id, dead, reply, dropped = _kill_mid_request(gw, handles, clock)
        (alive,) = set(handles) - {dead}
        assert not isinstance(reply, Exception), reply
        assert reply.model_extra["asyncrl"]["engine_id"] == alive
        assert dropped == [(dead, "heartbeat timeout")]  # noticed by the heartbeat window, not by the request deadline
        assert _live_engines(gw) == {alive}  # out of routing
        (turn,) = gw.service.store.get(rollout_id).turns
        assert turn.engine_id == alive and turn.timings["retries"] == 1.0
        # New rollouts go to the survivor only.
        _, key = gw.open()
        assert gw.openai(key).chat.completions.create(model="policy", messages=USER).model_extra["asyncrl"]["engine_id"] == alive


def test_with_no_retries_a_killed_engine_fails_fast_with_a_clear_status(engines, tmp_path) -> None:
    handles = {e.engine_id: Pausable(e) for e in engines}
    clock = ManualClock()
    service = make_service(open_store(tmp_path), list(handles.values()), clock=clock, engine_retries=0, **FAST_HEARTBEATS)
    with LiveGateway(service) as gw:
        rollout_id, dead, error, dropped = _kill_mid_request(gw, handles, clock)
        assert isinstance(error, openai.APIStatusError) and error.status_code == 503
        assert f"engine {dead} left the gateway (heartbeat timeout)" in error.message
        assert "gateway.engine_retries=0" in error.message
        assert dropped == [(dead, "heartbeat timeout")]
        assert gw.service.store.get(rollout_id).turns == []  # nothing half-recorded
        assert dead not in _live_engines(gw)


def test_a_hung_engine_cannot_hold_a_request_past_its_deadline(engines, tmp_path) -> None:
    stuck = Pausable(engines[0])
    # The clock never moves: however late its heartbeats come, the engine stays, and only the deadline can end the wait.
    service = make_service(open_store(tmp_path), [stuck], clock=ManualClock(), request_timeout_s=0.5, **FAST_HEARTBEATS)
    with LiveGateway(service) as gw:
        _, key = gw.open()
        stuck.pause()  # alive and heartbeating, but never answers
        with pytest.raises(openai.APIStatusError) as caught:
            gw.openai(key).chat.completions.create(model="policy", messages=USER)
        assert caught.value.status_code == 504 and "request_timeout_s=0.5" in caught.value.message
        stuck.resume()


def test_no_engine_is_a_503(tmp_path) -> None:
    with LiveGateway(make_service(open_store(tmp_path), [])) as gw:
        _, key = gw.open()
        with pytest.raises(openai.APIStatusError) as caught:
            gw.openai(key).chat.completions.create(model="policy", messages=USER)
        assert caught.value.status_code == 503 and "no engine is registered" in caught.value.message


def test_remote_engines_register_heartbeat_and_expire(engines, tmp_path) -> None:
    remote = EngineServer(engines[1])
    remote.start()
    clock = ManualClock()
    try:
        with LiveGateway(make_service(open_store(tmp_path), [], clock=clock, **FAST_HEARTBEATS)) as gw:
            as_engine = {"Authorization": f"Bearer {gw.engine_token}"}
            bad = gw.http.post("/engines/register", json={"engine_id": "r", "address": "tcp://nowhere"}, headers=as_engine)
            assert bad.status_code == 400 and "http://" in bad.json()["error"]["message"]
            register = {"engine_id": "remote-1", "address": remote.url, "capacity": 2.0}
            registered = gw.http.post("/engines/register", json=register, headers=as_engine).json()
            assert registered["registered"] is True and registered["lease"]
            _, key = gw.open()
            reply = gw.openai(key).chat.completions.create(model="policy", messages=USER, tools=TOOLS, max_tokens=12)
            assert reply.model_extra["asyncrl"]["engine_id"] == "e1"  # the engine's own id, as it reported it
            assert reply.choices[0].message.tool_calls[0].function.name == "f"
            beat = {"lease": registered["lease"], "health": {"load": 0}}
            assert gw.http.post("/engines/remote-1/heartbeat", json=beat, headers=as_engine).json() == {"registered": True}
            clock.advance(FAST_HEARTBEATS["heartbeat_timeout_s"] + 0.1)  # silence past the window
            assert _live_engines(gw) == set()
            assert gw.http.post("/engines/remote-1/heartbeat", json=beat, headers=as_engine).json() == {"registered": False}
    finally:
        remote.stop()


def test_a_refused_remote_connection_is_retried_elsewhere(engines, tmp_path) -> None:
    with LiveGateway(make_service(open_store(tmp_path), [engines[0]], engine_retries=2)) as gw:
        # An engine that registered and then vanished: nothing listens on its port.
        # capacity 64 (the most) makes it the home of most rollouts
        gone = {"engine_id": "gone", "address": "http://127.0.0.1:9", "capacity": 64.0}
        gw.http.post("/engines/register", json=gone, headers={"Authorization": f"Bearer {gw.engine_token}"}).raise_for_status()
        groups = (f"g{i}" for i in itertools.count())
        rollout_id, key = gw.open(group_id=next(groups))
        while _home(gw, rollout_id) != "gone":  # make it certain
            rollout_id, key = gw.open(group_id=next(groups))
        reply = gw.openai(key).chat.completions.create(model="policy", messages=USER)
        assert reply.model_extra["asyncrl"]["engine_id"] == "e0"
        assert gw.service.store.get(rollout_id).turns[0].timings["retries"] == 1.0
