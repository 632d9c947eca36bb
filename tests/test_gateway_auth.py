"""Who may call what on a live gateway: the run token for the lifecycle and scoring, the engine token for
engine registration, a holder secret (lease) per engine id, bounded registrations, and `gateway.auth: false`
on loopback. Every request here is real HTTP to a real gateway in front of real tiny engines."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from gateway_helpers import EngineServer, LiveGateway, ManualClock, Pausable, live_engines, make_engine, make_service
from pydantic import ValidationError

from asyncrl.configs.schema import GatewayConfig
from asyncrl.gateway.auth import Credentials
from asyncrl.gateway.client import GatewayClient, GatewayRefused
from asyncrl.gateway.engines import Announcement, AnnouncementRefused
from asyncrl.gateway.store import open_store

USER = [{"role": "user", "content": "hi"}]
FAST_HEARTBEATS = dict(heartbeat_interval_s=0.05, heartbeat_timeout_s=0.4)
NOWHERE = "http://127.0.0.1:9"
"""An engine address nothing listens on."""


@pytest.fixture(scope="module")
def engine():
    engine = make_engine("e0")
    yield engine
    engine.shutdown()


@pytest.fixture
def gateway(engine, tmp_path):
    with LiveGateway(make_service(open_store(tmp_path), [engine])) as gw:
        yield gw


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def as_engine(gw: LiveGateway) -> dict[str, str]:
    return bearer(gw.engine_token)


def wait_until_gone(gw: LiveGateway, engine_id: str) -> None:
    """Until the gateway dropped `engine_id` for silence (every /health call expires silent engines)."""
    deadline = time.monotonic() + 30
    while engine_id in live_engines(gw):
        assert time.monotonic() < deadline, f"{engine_id} never expired"
        time.sleep(0.02)


def served_by(gw: LiveGateway) -> str:
    _, key = gw.open()
    reply = gw.openai(key).chat.completions.create(model="policy", messages=USER, max_tokens=4)
    return reply.model_extra["asyncrl"]["engine_id"]


def refused(response: httpx.Response, status: int, *fragments: str) -> None:
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    for fragment in fragments:
        assert fragment in message, message


def test_tokens_are_derived_distinct_and_never_shown() -> None:
    secret = bytes(range(32))
    tokens = Credentials.from_secret(secret)
    assert tokens == Credentials.from_secret(secret)  # every gateway of a run derives the same ones
    assert tokens.run_token.startswith("rt-") and tokens.engine_token.startswith("et-")
    assert tokens.run_token != tokens.engine_token and Credentials.from_secret(bytes(32)).run_token != tokens.run_token
    assert tokens.run_token[3:] not in repr(tokens) and tokens.engine_token[3:] not in repr(tokens)
    assert tokens.is_run_token(tokens.run_token) and not tokens.is_run_token(tokens.engine_token)
    assert not tokens.is_engine_token(None) and not tokens.is_engine_token("et-\u00ff")


def test_engine_registration_needs_the_engine_token(gateway) -> None:
    fake = {"engine_id": "fake", "address": NOWHERE}
    refused(httpx.post(gateway.url + "/engines/register", json=fake), 401, "engine token", "Authorization: Bearer")
    refused(gateway.http.post("/engines/register", json=fake), 401, "is the run token", "engine token")
    _, key = gateway.open()
    refused(gateway.http.post("/engines/register", json=fake, headers=bearer(key)), 401, "rollout key")
    refused(gateway.http.post("/engines/register", json=fake, headers=bearer("et-" + "0" * 48)), 401, "did not issue")
    refused(httpx.post(gateway.url + "/engines/e0/heartbeat", json={"lease": "x"}), 401, "engine token")
    refused(httpx.post(gateway.url + "/engines/e0/deregister", json={"lease": "x"}), 401, "engine token")
    assert live_engines(gateway) == {"e0"}
    assert served_by(gateway) == "e0"


def test_a_live_engine_id_cannot_be_taken_over(gateway) -> None:
    # The gateway's own engine: its id is in /health and in every reply, and still not up for grabs.
    hijack = {"engine_id": "e0", "address": NOWHERE, "capacity": 64.0}
    refused(gateway.http.post("/engines/register", json=hijack, headers=as_engine(gateway)), 409, "'e0'")
    refused(gateway.http.post("/engines/e0/heartbeat", json={"lease": "guess"}, headers=as_engine(gateway)), 409, "'e0'")
    refused(gateway.http.post("/engines/e0/deregister", json={"lease": "guess"}, headers=as_engine(gateway)), 409, "'e0'")
    # A remote engine's id answers to the holder of its lease only.
    mine = {"engine_id": "remote-1", "address": NOWHERE}
    lease = gateway.http.post("/engines/register", json=mine, headers=as_engine(gateway)).json()["lease"]
    for wrong in (None, "guess", lease[:-1]):
        taken = gateway.http.post("/engines/register", json={**mine, "capacity": 64.0, "lease": wrong}, headers=as_engine(gateway))
        refused(taken, 409, "'remote-1'", "holder secret")
    refused(gateway.http.post("/engines/remote-1/heartbeat", json={"lease": "guess"}, headers=as_engine(gateway)), 409, "'remote-1'")
    again = gateway.http.post("/engines/register", json={**mine, "capacity": 2.0, "lease": lease}, headers=as_engine(gateway))
    assert again.json() == {"registered": True, "lease": lease}
    engines = {e["engine_id"]: e["capacity"] for e in gateway.http.get("/health").json()["engines"]}
    assert engines == {"e0": 1.0, "remote-1": 2.0}
    left = gateway.http.post("/engines/remote-1/deregister", json={"lease": lease}, headers=as_engine(gateway))
    assert left.json() == {"deregistered": True} and live_engines(gateway) == {"e0"}
    assert served_by(gateway) == "e0"  # the real engine kept serving throughout


def test_registration_fields_are_bounded(gateway) -> None:
    bad = [
        ({"capacity": 1_000_000.0}, "capacity"),  # once: a ring of 128 million points built on the event loop
        ({"capacity": 0}, "capacity"),
        ({"engine_id": "x" * 129}, "engine_id"),
        ({"engine_id": "a/b"}, "engine_id"),
        ({"engine_id": ""}, "engine_id"),
        ({"address": "ftp://host"}, "http://"),
        ({"address": "http://"}, "no host"),
        ({"address": "http://h/" + "x" * 600}, "address"),
        ({"health": {str(i): i for i in range(65)}}, "health"),
        ({"health": {"log": "x" * 20_000}}, "bytes"),
    ]
    for change, fragment in bad:
        body = {"engine_id": "big", "address": NOWHERE, **change}
        refused(gateway.http.post("/engines/register", json=body, headers=as_engine(gateway)), 400, fragment)
    assert live_engines(gateway) == {"e0"}


def test_lifecycle_and_scoring_need_the_run_token(gateway) -> None:
    rollout_id, key = gateway.open()
    calls = [
        ("POST", "/rollouts", {"task": "t"}),
        ("POST", f"/rollouts/{rollout_id}/finish", {"reward": -100.0}),
        ("POST", f"/rollouts/{rollout_id}/abort", {"reason": "stranger"}),
        ("GET", f"/rollouts/{rollout_id}", None),
        ("POST", "/v1/tokens/score", {"sequences": [[5, 6, 7]]}),
    ]
    for method, path, body in calls:
        for token, fragment in ((None, "needs the run token"), (key, "rollout key"), (gateway.engine_token, "is the engine token")):
            refused(httpx.request(method, gateway.url + path, json=body, headers=bearer(token)), 401, fragment, "run token")
        refused(httpx.request(method, gateway.url + path, json=body, headers=bearer("rt-" + "0" * 48)), 401, "did not issue")
    assert gateway.service.store.get(rollout_id).status == "running"  # nobody finished it with reward -100
    with GatewayClient(gateway.url) as stranger, pytest.raises(GatewayRefused) as caught:
        stranger.finish(rollout_id, reward=-100.0)
    assert caught.value.status == 401
    for open_route in ("/health", "/v1/models", "/openapi.json"):
        assert httpx.get(gateway.url + open_route).status_code == 200


def test_with_the_right_tokens_everything_works(gateway) -> None:
    with GatewayClient(gateway.url, token=gateway.run_token) as client:
        rollout = client.open_rollout(task="t", group_id="g")
        reply = rollout.openai(max_retries=0).chat.completions.create(model="policy", messages=USER, max_tokens=4)
        assert reply.model_extra["asyncrl"]["rollout_id"] == rollout.rollout_id
        assert client.get(rollout.rollout_id)["turns"] == 1
        assert client.finish(rollout.rollout_id, reward=1.0)["status"] == "ok"
        assert client.abort(client.open_rollout(task="t").rollout_id)["status"] == "aborted"
    scored = gateway.http.post("/v1/tokens/score", json={"sequences": [[5, 6, 7]]}, headers=bearer(gateway.run_token))
    assert scored.status_code == 200 and len(scored.json()["logprobs"][0]) == 3
    schemes = gateway.http.get("/openapi.json").json()["components"]["securitySchemes"]
    assert {"RunToken", "EngineToken"} <= set(schemes)


def test_a_remote_engine_announces_itself_with_the_engine_token(engine, tmp_path) -> None:
    remote = make_engine("r0")
    try:
        with EngineServer(remote) as address, LiveGateway(make_service(open_store(tmp_path), [])) as gw:

            async def announce() -> None:
                intruder = Announcement(gw.url, "r0", address, token=gw.run_token)
                with pytest.raises(AnnouncementRefused, match="engine token") as caught:
                    await intruder.register()
                assert caught.value.status == 401
                await intruder.aclose()
                announcement = Announcement(gw.url, "r0", address, token=gw.engine_token, health=remote.health)
                await announcement.register()
                assert announcement.lease and live_engines(gw) == {"r0"}
                squatter = Announcement(gw.url, "r0", NOWHERE, token=gw.engine_token)
                with pytest.raises(AnnouncementRefused, match="'r0'"):
                    await squatter.register()
                await squatter.aclose()
                await announcement.heartbeat()
                assert await asyncio.to_thread(served_by, gw) == "r0"
                await announcement.deregister()
                assert live_engines(gw) == set()
                await announcement.aclose()

            asyncio.run(announce())
    finally:
        remote.shutdown()


def test_an_expired_engine_id_is_free_again(tmp_path) -> None:
    clock = ManualClock()
    with LiveGateway(make_service(open_store(tmp_path), [], clock=clock, **FAST_HEARTBEATS)) as gw:
        first = gw.http.post("/engines/register", json={"engine_id": "r", "address": NOWHERE}, headers=as_engine(gw)).json()["lease"]
        clock.advance(FAST_HEARTBEATS["heartbeat_timeout_s"] + 0.1)
        wait_until_gone(gw, "r")  # its holder stopped heartbeating; the gateway's own loop never beats for it
        second = gw.http.post("/engines/register", json={"engine_id": "r", "address": NOWHERE}, headers=as_engine(gw)).json()["lease"]
        assert second != first and live_engines(gw) == {"r"}
        stale = gw.http.post("/engines/r/heartbeat", json={"lease": first}, headers=as_engine(gw))
        refused(stale, 409, "'r'")  # the old holder cannot keep or take the new registration


def test_an_engine_the_gateway_runs_keeps_its_id_while_it_is_expired(engine, tmp_path) -> None:
    silent = Pausable(engine)
    with LiveGateway(make_service(open_store(tmp_path), [silent], **FAST_HEARTBEATS)) as gw:
        silent.kill()  # fails its health checks: the gateway's heartbeats stop, and it expires
        wait_until_gone(gw, "e0")
        hijack = {"engine_id": "e0", "address": NOWHERE}
        refused(gw.http.post("/engines/register", json=hijack, headers=as_engine(gw)), 409, "'e0'", "runs itself")
        assert live_engines(gw) == set()


def test_auth_false_on_loopback_checks_no_tokens_but_still_guards_engine_ids(engine, tmp_path) -> None:
    with pytest.raises(ValidationError, match="auth"):
        GatewayConfig(auth=False, host="0.0.0.0")
    with LiveGateway(make_service(open_store(tmp_path), [engine], auth=False)) as gw:
        with GatewayClient(gw.url) as client:
            rollout = client.open_rollout(task="t")
            assert client.finish(rollout.rollout_id, reward=1.0)["status"] == "ok"
        assert httpx.post(gw.url + "/v1/tokens/score", json={"sequences": [[5, 6]]}).status_code == 200
        registered = httpx.post(gw.url + "/engines/register", json={"engine_id": "r", "address": NOWHERE})
        assert registered.status_code == 200 and live_engines(gw) == {"e0", "r"}
        refused(httpx.post(gw.url + "/engines/register", json={"engine_id": "r", "address": NOWHERE}), 409, "'r'")
        refused(httpx.post(gw.url + "/engines/register", json={"engine_id": "e0", "address": NOWHERE}), 409, "'e0'")


def test_a_url_teacher_scores_with_the_token_its_config_names(gateway, monkeypatch) -> None:
    """distill.teachers.NAME.token_env: the teacher's run token comes from the environment, never the config file."""
    from asyncrl.configs import load_config
    from asyncrl.distill.teachers import HttpTeacher, TeacherError, Teachers

    def teacher(token_env: str) -> HttpTeacher:
        teachers = f"distill.teachers={{t: {{url: '{gateway.url}', token_env: {token_env}}}}}"
        config = load_config("quickstart", [teachers, "learner.group_size=1"])
        return Teachers.from_config(config, {}).handles["t"]

    monkeypatch.setenv("ASYNCRL_TEST_TEACHER_TOKEN", gateway.run_token)
    (logprobs,) = asyncio.run(teacher("ASYNCRL_TEST_TEACHER_TOKEN").score([[5, 6, 7]], 1.0))
    assert len(logprobs) == 3
    monkeypatch.setenv("ASYNCRL_TEST_TEACHER_TOKEN", gateway.engine_token)  # the wrong token: refused, and said so
    with pytest.raises(TeacherError, match="refused the run token"):
        asyncio.run(teacher("ASYNCRL_TEST_TEACHER_TOKEN").score([[5, 6, 7]], 1.0))
    with pytest.raises(TeacherError, match=r"distill\.teachers\.t\.token_env: environment variable ASYNCRL_NO_SUCH_TOKEN is not set"):
        teacher("ASYNCRL_NO_SUCH_TOKEN")
