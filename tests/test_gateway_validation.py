"""Nothing a client sends makes the gateway fail: malformed requests, forged keys and tokens, oversized
bodies, slow and half-closed connections each get a 4xx that says what is wrong (or, for a client that
left, nothing), never a 5xx; the gateway keeps serving everyone else meanwhile and leaks no running
request. A schemathesis run over the gateway's own OpenAPI schema, every route, finds no 5xx.

Where the gateway authenticates (`service.credentials`), every request carries the token its route
needs: the run token on lifecycle and scoring routes, the engine token on engine routes, a rollout key
on the OpenAI and token-generation routes; `test_*_without_the_right_token_*` checks the refusals."""

from __future__ import annotations

import json
import select
import socket
import time

import pytest
from gateway_helpers import TOKENIZER, LiveGateway, Pausable, make_engine, make_service
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from asyncrl.gateway.store import open_store
from asyncrl.policy.tokenizer import ASSISTANT

LIMITS = dict(max_tokens=8, max_messages=4, max_prompt_tokens=64, max_body_bytes=4096, max_branches=2, max_tokens_fit="refuse")
USER = [{"role": "user", "content": "hi"}]
EXAMPLES = 15
"""Generated requests per operation and mode: bounded so the run stays a few seconds."""
WAIT_S = 60.0
"""Longest wait for the gateway to reach a state (a safety valve, not a timing: waits end on the state)."""


@pytest.fixture(scope="module")
def engine():
    engine = make_engine("e0")
    yield engine
    engine.shutdown()


def _live(tmp_path_factory, engine, **limits) -> LiveGateway:
    return LiveGateway(make_service(open_store(tmp_path_factory.mktemp("store")), [engine], **limits))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, engine):
    with _live(tmp_path_factory, engine, **LIMITS) as gw:
        gw.rollout_id, gw.key = _open(gw)
        gw.other_id, gw.other_key = _open(gw)
        gw.ended_id, gw.ended_key = _open(gw)
        assert gw.http.post(f"/rollouts/{gw.ended_id}/finish", json={"reward": 1.0}, headers=_auth(gw, "/rollouts")).status_code == 200
        yield gw


# --- who sends what ---------------------------------------------------------------------------------


def _credentials(gateway):
    return getattr(gateway.service, "credentials", None)


def _token(gateway, path: str) -> str | None:
    """The bearer a legitimate caller of `path` sends: the run or engine token, or the fixture's rollout key."""
    credentials = _credentials(gateway)
    if path.startswith("/engines"):
        return credentials.engine_token if credentials else None
    if path.startswith("/rollouts") or path == "/v1/tokens/score":
        return credentials.run_token if credentials else None
    return getattr(gateway, "key", None)


def _auth(gateway, path: str) -> dict:
    token = _token(gateway, path)
    return {"Authorization": f"Bearer {token}"} if token else {}


def _open(gateway) -> tuple[str, str]:
    response = gateway.http.post("/rollouts", json={"task": "t", "group_id": "g"}, headers=_auth(gateway, "/rollouts"))
    assert response.status_code == 200, response.text
    return response.json()["rollout_id"], response.json()["api_key"]


ANTHROPIC_4XX = {"invalid_request_error", "authentication_error", "not_found_error", "conflict_error", "request_too_large"}


def _error(response) -> str:
    """The error message of a 4xx answer in the gateway's OpenAI error shape (Anthropic's on the Messages routes)."""
    assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text[:300]}"
    body = response.json()
    error = body["error"]
    if response.request.url.path.startswith("/v1/messages"):
        assert body["type"] == "error" and error["type"] in ANTHROPIC_4XX and set(error) == {"type", "message"}, body
    else:
        assert error["type"] == "invalid_request_error", error
    return error["message"]


def _chat(**fields) -> dict:
    return {"messages": USER, **fields}


# --- malformed requests, every route ------------------------------------------------------------------

DEEP = b'{"task": "t", "metadata": {"a": ' + b"[" * 1500 + b"]" * 1500 + b"}}"
DEEP_CHAT = b'{"messages": [{"role": "user", "content": "x"}], "user": ' + b"[" * 1500 + b"]" * 1500 + b"}"

CASES = [
    ("POST /v1/chat/completions", b"{not json", 400, "JSON"),
    ("POST /v1/chat/completions", b"\xff\xfe{", 400, "Invalid JSON"),
    ("POST /v1/chat/completions", DEEP_CHAT, 400, "recursion limit"),
    ("POST /v1/chat/completions", ("text/plain", b"{}"), 400, "Content-Type: application/json"),
    ("POST /v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("POST /v1/chat/completions", {"messages": []}, 400, "messages"),
    ("POST /v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    (
        "POST /v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "only text parts",
    ),
    (
        "POST /v1/chat/completions",
        {"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
        400,
        "only assistant messages carry tool_calls",
    ),
    ("POST /v1/chat/completions", _chat(stream="maybe"), 400, "stream"),
    ("POST /v1/chat/completions", _chat(stream=True, stream_options=[]), 400, "stream_options"),
    ("POST /v1/chat/completions", _chat(stream=True, stream_options={"include_usage": "perhaps"}), 400, "include_usage"),
    ("POST /v1/chat/completions", _chat(stream=True, n=2), 400, "n must be 1"),
    ("POST /v1/chat/completions", _chat(stream=True, max_tokens=9), 400, "gateway.max_tokens_fit is refuse"),
    ("POST /v1/chat/completions", _chat(stream=True, tool_choice="required"), 400, "tool_choice"),
    ("POST /v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 80}], "stream": True}, 400, "gateway.max_prompt_tokens"),
    ("POST /v1/completions", {"prompt": "hi", "stream": True, "logprobs": 1}, 400, "logprobs with stream=true"),
    ("POST /v1/completions", {"prompt": ["a", "b"], "stream": True}, 400, "one prompt per request"),
    ("POST /v1/chat/completions", _chat(n=2), 400, "n must be 1"),
    ("POST /v1/chat/completions", _chat(max_tokens=9), 400, "gateway.max_tokens 8"),
    ("POST /v1/chat/completions", _chat(max_tokens=0), 400, "max_tokens"),
    ("POST /v1/chat/completions", _chat(max_tokens="many"), 400, "max_tokens"),
    ("POST /v1/chat/completions", _chat(temperature=-1), 400, "temperature"),
    ("POST /v1/chat/completions", _chat(temperature=1e-300), 400, "use 0 for greedy"),
    ("POST /v1/chat/completions", _chat(seed=2**64), 400, "seed"),
    ("POST /v1/chat/completions", _chat(presence_penalty=0.5), 400, "presence_penalty is not supported"),
    ("POST /v1/chat/completions", _chat(tool_choice="required"), 400, "tool_choice"),
    ("POST /v1/chat/completions", _chat(stop=["ab"]), 400, "only single-token stops"),
    ("POST /v1/chat/completions", _chat(tools=[{"type": "function"}]), 400, "tools[0]"),
    ("POST /v1/chat/completions", {"messages": USER * 5}, 400, "gateway.max_messages is 4"),
    ("POST /v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 80}]}, 400, "gateway.max_prompt_tokens is 64"),
    ("POST /v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]}, 413, "gateway.max_body_bytes"),
    ("GET /v1/chat/completions", None, 405, "Method Not Allowed"),
    ("POST /v1/completions", {"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("POST /v1/completions", {"prompt": ""}, 400, "prompt is empty"),
    ("POST /v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("POST /v1/completions", {"prompt": {"text": "hi"}}, 400, "prompt"),
    ("POST /v1/completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("POST /v1/messages", b"{not json", 400, "JSON"),
    ("POST /v1/messages", {"max_tokens": 8, "messages": "hi"}, 400, "messages"),
    ("POST /v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens: Field required"),
    ("POST /v1/messages", {"max_tokens": 8, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("POST /v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [7]}]}, 400, "content"),
    (
        "POST /v1/messages",
        {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"}]}]},
        400,
        "messages[0].content[0].tool_use_id 'toolu_1' matches no tool_use block",
    ),
    (
        "POST /v1/messages",
        {"max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "r"}]}]},
        400,
        "messages[0].content[0].tool_use_id must be a non-empty string",
    ),
    ("POST /v1/messages", {"max_tokens": 8, "stream": True, "messages": USER * 5}, 400, "gateway.max_messages is 4"),
    ("POST /v1/messages", {"max_tokens": 9, "stream": True, "messages": USER}, 400, "gateway.max_tokens 8"),
    ("POST /v1/messages", {"max_tokens": 8, "messages": USER, "tools": [{"name": "f", "input_schema": "{}"}]}, 400, "tools[0]"),
    ("POST /v1/messages/count_tokens", {"messages": []}, 400, "messages"),
    ("POST /v1/messages/count_tokens", {"messages": [{"role": "assistant", "content": "x"}]}, 400, "prefilling"),
    ("GET /v1/messages", None, 405, "Method Not Allowed"),
    ("POST /v1/tokens/generate", {"prompt_token_ids": [5, 100000]}, 400, "outside the vocabulary"),
    ("POST /v1/tokens/generate", {"prompt_token_ids": [5, -1]}, 400, "outside the vocabulary"),
    ("POST /v1/tokens/generate", {"prompt_token_ids": []}, 400, "prompt_token_ids"),
    ("POST /v1/tokens/generate", {"prompt_token_ids": ["a"]}, 400, "prompt_token_ids"),
    ("POST /v1/tokens/generate", {"prompt_token_ids": [5], "bogus": 1}, 400, "bogus"),
    ("POST /v1/tokens/generate", {"prompt_token_ids": [5], "top_p": 0}, 400, "top_p"),
    ("POST /v1/tokens/score", {"sequences": []}, 400, "sequences"),
    ("POST /v1/tokens/score", {"sequences": [[]]}, 400, "sequence 0 is empty"),
    ("POST /v1/tokens/score", {"sequences": [[5, 1000000]]}, 400, "outside the vocabulary"),
    ("POST /v1/tokens/score", {"sequences": [[5, 6]], "temperature": -1}, 400, "temperature"),
    ("POST /v1/tokens/score", {"sequences": [[5] * 1100]}, 400, "more than the model's 1024"),
    ("POST /v1/tokens/score", {"sequences": [[5]], "bogus": 1}, 400, "bogus"),
    ("POST /rollouts", {"task": 3}, 400, "task"),
    ("POST /rollouts", {"group_id": ["g"]}, 400, "group_id"),
    ("POST /rollouts", {"metadata": []}, 400, "metadata"),
    ("POST /rollouts", {"evaluation": "perhaps"}, 400, "evaluation"),
    ("POST /rollouts", {"rollout_id": "mine"}, 400, "rollout_id"),
    ("POST /rollouts", DEEP, 400, "body"),
    ("POST /rollouts", b"\xff\xfe{", 400, "body"),
    ("POST /rollouts/x/finish", {}, 400, "reward"),
    ("POST /rollouts/{rollout}/finish", b'{"reward": NaN}', 400, "reward: Input should be a finite number"),
    ("POST /rollouts/{rollout}/finish", {"reward": "high"}, 400, "reward"),
    ("POST /rollouts/{rollout}/finish", {"reward": 1, "status": "aborted"}, 400, "status"),
    ("POST /rollouts/{rollout}/finish", {"reward": 1, "metrics": [1]}, 400, "metrics"),
    ("POST /rollouts/{rollout}/finish", {"reward": 1, "bonus": 1}, 400, "bonus"),
    ("POST /rollouts/{rollout}/abort", {"reason": 5}, 400, "reason"),
    ("POST /rollouts/nope/finish", {"reward": 1}, 404, "no rollout 'nope'"),
    ("POST /rollouts/nope/abort", {}, 404, "no rollout 'nope'"),
    ("GET /rollouts/nope", None, 404, "no rollout 'nope'"),
    ("POST /rollouts/{ended}/finish", {"reward": 1}, 409, "cannot finish"),
    ("POST /rollouts/{ended}/abort", {}, 409, "cannot abort"),
    ("POST /engines/register", {"engine_id": "", "address": "http://x"}, 400, "engine_id"),
    ("POST /engines/register", {"engine_id": "a b", "address": "http://x"}, 400, "engine_id"),
    ("POST /engines/register", {"engine_id": "x" * 300, "address": "http://x"}, 400, "engine_id"),
    ("POST /engines/register", {"engine_id": "x", "address": "ftp://x"}, 400, "address"),
    ("POST /engines/register", {"engine_id": "x", "address": "http://"}, 400, "address"),
    ("POST /engines/register", {"engine_id": "x", "address": "ray:nobody"}, 400, "Ray"),
    ("POST /engines/register", {"engine_id": "x", "address": "http://127.0.0.1:1", "capacity": 0}, 400, "capacity"),
    ("POST /engines/register", {"engine_id": "x", "address": "http://127.0.0.1:1", "capacity": 1e9}, 400, "capacity"),
    ("POST /engines/register", {"engine_id": "x", "address": "http://127.0.0.1:1", "health": []}, 400, "health"),
    ("POST /engines/register", {"engine_id": "e0", "address": "http://127.0.0.1:1"}, 409, "'e0'"),
    ("POST /engines/e0/heartbeat", {"lease": "forged"}, 409, "'e0'"),
    ("POST /engines/e0/heartbeat", {}, 400, "lease"),
    ("POST /engines/e0/deregister", {"lease": "forged"}, 409, "'e0'"),
    ("POST /engines/e0/deregister", {}, 400, "lease"),
    ("POST /nowhere", {}, 404, "Not Found"),
    ("DELETE /health", None, 405, "Method Not Allowed"),
]


def _path(gateway, template: str) -> str:
    return template.format(rollout=gateway.rollout_id, ended=gateway.ended_id)


@pytest.mark.parametrize(("route", "body", "status", "fragment"), CASES, ids=[f"{c[0]}:{c[3]}" for c in CASES])
def test_malformed_requests_get_a_4xx_that_says_what_is_wrong(gateway, route, body, status, fragment) -> None:
    method, template = route.split(" ")
    path = _path(gateway, template)
    headers = {**_auth(gateway, path), "Content-Type": "application/json"}
    if isinstance(body, tuple):
        headers["Content-Type"], body = body
    if isinstance(body, bytes):
        response = gateway.http.request(method, path, content=body, headers=headers)
    elif body is None:
        response = gateway.http.request(method, path, headers=headers)
    else:
        response = gateway.http.request(method, path, json=body, headers=headers)
    assert response.status_code == status, response.text
    assert fragment in _error(response)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", _chat()),
        ("/v1/chat/completions", _chat(stream=True)),
        ("/v1/completions", {"prompt": "hi", "stream": True}),
        ("/v1/messages", {"max_tokens": 8, "messages": USER}),
        ("/v1/messages", {"max_tokens": 8, "messages": USER, "stream": True}),
        ("/v1/messages/count_tokens", {"messages": USER}),
    ],
)
def test_a_call_on_an_ended_rollout_is_refused(gateway, path, body) -> None:
    """Streamed or not: a 409 before any stream starts, nothing recorded."""
    response = gateway.http.post(path, json=body, headers={"Authorization": f"Bearer {gateway.ended_key}"})
    assert response.status_code == 409 and "takes no more calls" in _error(response)
    assert _rollout_turns(gateway, gateway.ended_id) == 0


def test_a_probe_of_the_root_is_a_4xx(gateway) -> None:
    """Claude Code's first request is `HEAD /`, without a key."""
    for method in ("HEAD", "GET"):
        assert gateway.http.request(method, "/").status_code == 404


def test_the_max_tokens_clamp_samples_at_most_the_cap(tmp_path_factory, engine) -> None:
    """gateway.max_tokens_fit=clamp (the default; LIMITS refuses): a max_tokens above gateway.max_tokens gets a 200
    with at most gateway.max_tokens sampled, on every route."""
    with _live(tmp_path_factory, engine, max_tokens=4) as gateway:
        rollout_id, key = _open(gateway)
        headers = {"Authorization": f"Bearer {key}"}
        calls = [
            ("/v1/chat/completions", {"messages": USER, "max_tokens": 100000}),
            ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 100000, "stream": True}),
            ("/v1/completions", {"prompt": [TOKENIZER.convert_tokens_to_ids(ASSISTANT)], "max_tokens": 100000}),  # the script's start
            ("/v1/messages", {"messages": USER, "max_tokens": 64000}),
            ("/v1/messages", {"messages": USER, "max_tokens": 64000, "stream": True}),
        ]
        for path, body in calls:
            response = gateway.http.post(path, json=body, headers=headers)
            assert response.status_code == 200, (path, response.text)
        turns = gateway.service.store.get(rollout_id).turns
        assert len(turns) == len(calls) and all(len(t.completion_token_ids) <= 4 for t in turns)
        assert {t.finish_reason for t in turns} == {"length"}  # the script is longer than 4 tokens


def test_too_many_branches(gateway) -> None:
    _, key = _open(gateway)
    client = gateway.openai(key)
    for i in range(2):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"v{i}"}])
    response = gateway.http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "v3"}]}, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code == 400 and "max_branches" in _error(response)


# --- raw HTTP: what a client library would not send ----------------------------------------------------


def _connect(gateway) -> socket.socket:
    host, port = gateway.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _head(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: gateway", *(name + b": " + value for name, value in headers)]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one response; (0, b"") if the gateway closed the connection without one."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), None)
    while length is not None and len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, body


def _raw(gateway, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes = b"") -> tuple[int, bytes]:
    with _connect(gateway) as sock:
        sock.sendall(_head(method, path, [*headers, (b"Content-Length", str(len(body)).encode()), (b"Connection", b"close")]) + body)
        return _read_response(sock)


def _request(path: str, bearer: str, body: bytes) -> bytes:
    """A JSON POST with its bearer token, as bytes on the wire."""
    headers = [JSON, (b"Authorization", f"Bearer {bearer}".encode()), (b"Content-Length", str(len(body)).encode())]
    return _head("POST", path, headers) + body


def _a_later_chat_works(gateway) -> bool:
    response = gateway.http.post("/v1/chat/completions", json=_chat(), headers={"Authorization": f"Bearer {_open(gateway)[1]}"})
    return response.status_code == 200


def _chat_body() -> bytes:
    return json.dumps(_chat()).encode()


def _message(body: bytes) -> str:
    return json.loads(body)["error"]["message"]


JSON = (b"Content-Type", b"application/json")
ROLLOUT_ROUTES = [
    ("/v1/chat/completions", json.dumps(_chat()).encode()),
    ("/v1/chat/completions", json.dumps(_chat(stream=True)).encode()),
    ("/v1/messages", json.dumps({"max_tokens": 8, "messages": USER, "stream": True}).encode()),
    ("/v1/messages/count_tokens", json.dumps({"messages": USER}).encode()),
    ("/v1/completions", b'{"prompt": "hi"}'),
    ("/v1/tokens/generate", b'{"prompt_token_ids": [5]}'),
]


def _forged_keys(gateway) -> dict[str, bytes]:
    rollout_id, _, mac = gateway.key.removeprefix("rk-").rpartition(".")
    other_id = gateway.other_key.removeprefix("rk-").rpartition(".")[0]
    flipped = mac[:-1] + ("0" if mac[-1] != "0" else "1")
    keys = {
        "wrong MAC": f"rk-{rollout_id}.{flipped}",
        "another rollout's id": f"rk-{other_id}.{mac}",
        "truncated": gateway.key[:-5],
        "MAC only": f"rk-.{mac}",
        "no prefix": f"{rollout_id}.{mac}",
        "empty": "",
        "non-ASCII MAC": f"rk-{rollout_id}.{mac[:-1]}é",
        "non-ASCII id": f"rk-{rollout_id}é.{mac}",
        "control characters": f"rk-{rollout_id}\x01.{mac}",
    }
    forged = {name: b"Bearer " + key.encode("utf-8") for name, key in keys.items()}
    forged["no Bearer scheme"] = gateway.key.encode()
    credentials = _credentials(gateway)
    if credentials is not None:
        forged["the run token"] = f"Bearer {credentials.run_token}".encode()
        forged["the engine token"] = f"Bearer {credentials.engine_token}".encode()
    return forged


FORGERIES = [
    "wrong MAC", "another rollout's id", "truncated", "MAC only", "no prefix", "empty", "non-ASCII MAC", "non-ASCII id",
    "control characters", "no Bearer scheme", "the run token", "the engine token",
]  # fmt: skip


@pytest.mark.parametrize("forgery", FORGERIES)
@pytest.mark.parametrize(("path", "body"), ROLLOUT_ROUTES, ids=[f"{r[0]}:{i}" for i, r in enumerate(ROLLOUT_ROUTES)])
def test_a_forged_rollout_key_is_refused(gateway, path, body, forgery) -> None:
    forged = _forged_keys(gateway)
    if forgery not in forged:
        pytest.skip("this gateway has no run or engine token")
    turns_before = _rollout_turns(gateway, gateway.rollout_id)
    status, reply = _raw(gateway, "POST", path, [JSON, (b"Authorization", forged[forgery])], body)
    if forgery == "control characters":  # not a valid header value: the HTTP parser refuses the request
        assert (status, reply) == (400, b"Invalid HTTP request received.")
    else:
        assert status == 401, reply
        assert "rollout key" in _message(reply)
    assert _rollout_turns(gateway, gateway.rollout_id) == turns_before  # nothing was recorded for the forger


def test_the_real_key_passes_where_forgeries_fail(gateway) -> None:
    _, key = _open(gateway)
    status, reply = _raw(gateway, "POST", "/v1/chat/completions", [JSON, (b"Authorization", f"Bearer {key}".encode())], _chat_body())
    assert status == 200, reply


def _rollout_turns(gateway, rollout_id: str) -> int:
    response = gateway.http.get(f"/rollouts/{rollout_id}", headers=_auth(gateway, "/rollouts"))
    assert response.status_code == 200, response.text
    return response.json()["turns"]


# --- tokens on lifecycle and engine routes ---------------------------------------------------------------

PROTECTED = [
    ("POST", "/rollouts", b"{}", "run"),
    ("POST", "/rollouts/{rollout}/finish", b'{"reward": 1}', "run"),
    ("POST", "/rollouts/{rollout}/abort", b"{}", "run"),
    ("GET", "/rollouts/{rollout}", b"", "run"),
    ("POST", "/v1/tokens/score", b'{"sequences": [[5, 6]]}', "run"),
    ("POST", "/engines/register", b'{"engine_id": "intruder", "address": "http://127.0.0.1:1"}', "engine"),
    ("POST", "/engines/e0/heartbeat", b'{"lease": "x"}', "engine"),
    ("POST", "/engines/e0/deregister", b'{"lease": "x"}', "engine"),
]
WRONG_TOKENS = ["none", "empty", "rollout key", "the other token", "forged", "non-ASCII"]


@pytest.mark.parametrize("wrong", WRONG_TOKENS)
@pytest.mark.parametrize(("method", "template", "body", "needed"), PROTECTED, ids=[f"{p[0]} {p[1]}" for p in PROTECTED])
def test_lifecycle_and_engine_routes_without_the_right_token_get_401(gateway, method, template, body, needed, wrong) -> None:
    credentials = _credentials(gateway)
    if credentials is None:
        pytest.skip("this gateway does not authenticate lifecycle and engine calls (no service.credentials)")
    token = {"run": credentials.run_token, "engine": credentials.engine_token}
    other = token["engine" if needed == "run" else "run"]
    bearer = {
        "none": None, "empty": b"Bearer ", "rollout key": f"Bearer {gateway.key}".encode(), "the other token": f"Bearer {other}".encode(),
        "forged": f"Bearer {token[needed][:3]}{'0' * (len(token[needed]) - 3)}".encode(), "non-ASCII": "Bearer rt-é".encode(),
    }[wrong]  # fmt: skip
    headers = [JSON] + ([(b"Authorization", bearer)] if bearer is not None else [])
    status, reply = _raw(gateway, method, _path(gateway, template), headers, body)
    assert status == 401, reply
    assert f"needs the {needed} token" in _message(reply)
    # The refusal changed nothing: the rollout still runs, the engine is still there.
    assert _rollout_status(gateway, gateway.rollout_id) == "running"
    assert [e["engine_id"] for e in gateway.service.health()["engines"]] == ["e0"]


def _rollout_status(gateway, rollout_id: str) -> str:
    return gateway.http.get(f"/rollouts/{rollout_id}", headers=_auth(gateway, "/rollouts")).json()["status"]


# --- oversized bodies -------------------------------------------------------------------------------------


def _post_routes(gateway) -> list[str]:
    """Every POST route of the gateway's schema (so a new route is covered as soon as it exists),
    with its path parameters filled in."""
    paths = gateway.http.get("/openapi.json").json()["paths"]
    fill = {"{rollout_id}": gateway.rollout_id, "{engine_id}": "e0"}
    routes = []
    for template, operations in paths.items():
        if "post" in operations:
            for name, value in fill.items():
                template = template.replace(name, value)
            routes.append(template)
    return routes


def test_the_schema_names_every_lifecycle_and_engine_route(gateway) -> None:
    paths = set(gateway.http.get("/openapi.json").json()["paths"])
    expected = {"/rollouts", "/rollouts/{rollout_id}", "/rollouts/{rollout_id}/finish", "/rollouts/{rollout_id}/abort",
                "/engines/register", "/engines/{engine_id}/heartbeat", "/v1/tokens/score", "/v1/tokens/generate",
                "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"}  # fmt: skip
    assert expected <= paths


def test_an_oversized_body_is_refused_on_every_route(gateway) -> None:
    """Declared (Content-Length over the limit), and streamed (chunked, no Content-Length): 413 naming the limit."""
    too_big = b'{"pad": "' + b"x" * 5000 + b'"}'
    for path in _post_routes(gateway):
        headers = {**_auth(gateway, path), "Content-Type": "application/json"}
        declared = gateway.http.post(path, content=too_big, headers=headers)
        assert declared.status_code == 413, (path, declared.text)
        assert "gateway.max_body_bytes (4096 bytes)" in _error(declared)
        streamed = gateway.http.post(path, content=(too_big[i : i + 1000] for i in range(0, len(too_big), 1000)), headers=headers)
        assert streamed.status_code == 413, (path, streamed.text)
        assert "gateway.max_body_bytes" in _error(streamed)


def test_a_huge_declared_body_is_refused_before_it_is_sent(gateway) -> None:
    """The refusal comes on the headers alone: the gateway does not wait for (or read) a terabyte."""
    with _connect(gateway) as sock:
        auth = _auth(gateway, "/rollouts").get("Authorization", "").encode()
        sock.sendall(_head("POST", "/rollouts", [JSON, (b"Authorization", auth), (b"Content-Length", b"1000000000000")]))
        status, reply = _read_response(sock)
    assert status == 413 and "gateway.max_body_bytes" in _message(reply)


@pytest.mark.parametrize("length", [b"abc", b"-1", b"1e3"])
def test_an_invalid_content_length_is_a_400(gateway, length) -> None:
    with _connect(gateway) as sock:
        sock.sendall(_head("POST", "/rollouts", [JSON, (b"Content-Length", length)]) + b"{}")
        status, reply = _read_response(sock)
    assert status == 400 and reply, reply  # refused by the HTTP parser: "Invalid HTTP request received."


# --- slow and half-closed clients --------------------------------------------------------------------------


def _answered(sock: socket.socket) -> bool:
    """Whether the gateway has sent anything on `sock` yet (without waiting)."""
    return bool(select.select([sock], [], [], 0)[0])


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"the gateway never reached: {what}")
        time.sleep(0.01)


def _idle(gateway) -> bool:
    """No request running in the gateway: none in uvicorn's task set, none at the engines."""
    return not gateway.server.server_state.tasks and gateway.service.calls.in_flight == 0


@pytest.mark.parametrize("stage", ["headers", "body"])
def test_slow_clients_do_not_hold_up_anyone_else(gateway, stage) -> None:
    """Twenty clients trickle a chat request a byte at a time (its headers, or its body); between their
    bytes, other sessions' chat calls complete, and none of the slow ones is answered before it is done."""
    body = _chat_body()
    keys = [_open(gateway)[1] for _ in range(20)]
    slow = [_connect(gateway) for _ in keys]
    requests = [_request("/v1/chat/completions", key, body)[: -len(body)] for key in keys]
    try:
        if stage == "body":
            for sock, request in zip(slow, requests, strict=True):
                sock.sendall(request)
            requests = [body] * len(slow)
        else:
            requests = [request + body for request in requests]
        quarter = min(len(r) for r in requests) // 4
        for at in range(max(len(r) for r in requests) - 1):
            for sock, request in zip(slow, requests, strict=True):
                if at < len(request) - 1:
                    sock.sendall(request[at : at + 1])
            if at % quarter == 0:  # four times during the trickle, the others are served meanwhile
                _, other = _open(gateway)
                response = gateway.http.post("/v1/chat/completions", json=_chat(), headers={"Authorization": f"Bearer {other}"})
                assert response.status_code == 200, response.text
                assert not any(_answered(sock) for sock in slow)
        for sock, request in zip(slow, requests, strict=True):
            sock.sendall(request[-1:])
        for sock in slow:
            status, reply = _read_response(sock)
            assert status == 200, reply
    finally:
        for sock in slow:
            sock.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/rollouts", "/rollouts/{rollout}/finish"])
def test_a_client_that_leaves_mid_body_leaks_nothing(gateway, path) -> None:
    path = _path(gateway, path)
    running, turns = gateway.service.health()["rollouts_running"], _rollout_turns(gateway, gateway.rollout_id)
    with _connect(gateway) as sock:
        whole = _request(path, _token(gateway, path) or "", b'{"messages": [' + b" " * 986)
        sock.sendall(whole[: whole.index(b"\r\n\r\n") + 4 + 14])  # the headers, then 14 of the 1000 bytes
    _wait_until(lambda: _idle(gateway), "no request running after the client left")
    # Half a request did nothing: no rollout opened or finished, no turn recorded; the next request works.
    assert gateway.service.health()["rollouts_running"] == running
    assert _rollout_status(gateway, gateway.rollout_id) == "running" and _rollout_turns(gateway, gateway.rollout_id) == turns
    assert _a_later_chat_works(gateway)


STREAMS = {
    "/v1/chat/completions": json.dumps(_chat(stream=True)).encode(),
    "/v1/completions": b'{"prompt": "hi", "stream": true}',
    "/v1/messages": json.dumps({"max_tokens": 8, "messages": USER, "stream": True}).encode(),
}


@pytest.mark.parametrize("path", list(STREAMS))
def test_a_stream_whose_client_leaves_at_once_leaks_nothing(gateway, path) -> None:
    """The client leaves as soon as its stream answers: nothing stays running or reserved (the turn is recorded
    truncated, or whole if it was done), and the rollout takes its next call."""
    rollout_id, key = _open(gateway)
    with _connect(gateway) as sock:
        sock.sendall(_request(path, key, STREAMS[path]))
        assert sock.recv(12).startswith(b"HTTP/1.1 200")
    in_flight = lambda: gateway.http.get(f"/rollouts/{rollout_id}", headers=_auth(gateway, "/rollouts")).json()["in_flight"]  # noqa: E731
    recording = gateway.service.background.running
    _wait_until(lambda: _idle(gateway) and not recording and in_flight() == 0, "nothing running after the client left")
    assert [t.finish_reason for t in gateway.service.store.get(rollout_id).turns] in (["abort"], ["length"], ["stop"])
    response = gateway.http.post("/v1/chat/completions", json=_chat(), headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/rollouts"])
def test_a_client_that_shuts_its_write_side_after_the_request_leaks_nothing(gateway, path) -> None:
    body = _chat_body() if path.startswith("/v1") else b"{}"
    with _connect(gateway) as sock:
        sock.sendall(_request(path, _token(gateway, path) or "", body))
        sock.shutdown(socket.SHUT_WR)
        status, reply = _read_response(sock)  # answered, or dropped as a connection the client ended
    assert status in (0, 200), reply
    _wait_until(lambda: _idle(gateway), "no request running after the client half-closed")
    assert gateway.http.get("/health").json()["requests_in_flight"] == 0
    assert _a_later_chat_works(gateway)


def test_a_client_gone_while_its_turn_generates_leaks_nothing(tmp_path_factory) -> None:
    """The engine holds the turn until the client has closed its connection; the gateway then finishes
    the call, keeps no request running, and the rollout takes its next call."""
    paused = Pausable(make_engine("held"))
    try:
        with _live(tmp_path_factory, paused) as gateway:
            rollout_id, key = _open(gateway)
            paused.pause()
            sock = _connect(gateway)
            sock.sendall(_request("/v1/chat/completions", key, _chat_body()))
            assert paused.started.wait(WAIT_S)
            sock.close()
            paused.resume()
            _wait_until(lambda: _idle(gateway), "the abandoned turn finished")
            assert gateway.http.get(f"/rollouts/{rollout_id}", headers=_auth(gateway, "/rollouts")).json()["in_flight"] == 0
            again = gateway.http.post("/v1/chat/completions", json=_chat(), headers={"Authorization": f"Bearer {key}"})
            assert again.status_code == 200, again.text
            assert gateway.http.get("/health").json()["status"] == "ok"
    finally:
        paused.engine.shutdown()


# --- generated requests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_generated_request_gets_a_5xx(tmp_path_factory, engine, mode) -> None:
    """Every operation of the gateway's OpenAPI schema (lifecycle and engine routes included), with
    schema-valid and schema-violating data, each sent with the credential its route takes (a valid
    rollout key for the generation routes, so requests reach rendering, routing and the engine). A
    fresh gateway per mode: engines that one mode registers must not take the other's traffic.
    (Driven by hand: schemathesis' pytest plugin does not run under pytest 9.)"""
    schemathesis = pytest.importorskip("schemathesis")
    with _live(tmp_path_factory, engine, **LIMITS) as gateway:
        gateway.rollout_id, gateway.key = _open(gateway)
        schema = schemathesis.openapi.from_url(gateway.url + "/openapi.json")
        server_errors, covered = [], set()
        for result in schema.get_all_operations():
            operation = result.ok()
            covered.add(operation.path)
            try:
                _fuzz(gateway, operation, schemathesis.GenerationMode(mode), server_errors)
            except Unsatisfiable:
                assert mode == "negative"  # an operation without inputs has no invalid ones (GET /health)
        assert {"/rollouts", "/rollouts/{rollout_id}/finish", "/engines/register", "/v1/messages", "/v1/messages/count_tokens"} <= covered
        assert not server_errors, "\n".join(server_errors[:5])


def _fuzz(gateway, operation, mode, server_errors: list[str]) -> None:
    headers = _auth(gateway, operation.path)

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        response = case.call(headers=headers, timeout=30)
        # A stream that failed after it started says so in an error event (its status was already 200).
        content_type = response.headers.get("content-type") or ""  # schemathesis: a list of the header's values
        failed_stream = "text/event-stream" in str(content_type) and ('"internal_error"' in response.text or '"api_error"' in response.text)
        if response.status_code >= 500 or failed_stream:
            server_errors.append(f"{case.method} {case.path} {case.body!r}: {response.status_code} {response.text[:300]}")

    check()
