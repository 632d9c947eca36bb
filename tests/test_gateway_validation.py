"""Nothing a client sends makes the gateway fail: malformed requests get a 4xx that says what is wrong,
and a schemathesis run over the gateway's own OpenAPI schema finds no 5xx."""

from __future__ import annotations

import pytest
from gateway_helpers import LiveGateway, make_engine, make_service
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from asyncrl.gateway.store import open_store

LIMITS = dict(max_tokens=8, max_messages=4, max_prompt_tokens=64, max_body_bytes=4096, max_branches=2)
USER = [{"role": "user", "content": "hi"}]
EXAMPLES = 15
"""Generated requests per operation and mode: bounded so the run stays a few seconds."""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    engine = make_engine("e0")
    with LiveGateway(make_service(open_store(tmp_path_factory.mktemp("store")), [engine], **LIMITS)) as gw:
        gw.key = gw.open()[1]
        yield gw
    engine.shutdown()


def _chat(**fields) -> dict:
    return {"messages": USER, **fields}


CASES = [
    ("/v1/chat/completions", b"{not json", 400, "JSON"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "only text parts"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
        400,
        "only assistant messages carry tool_calls",
    ),
    ("/v1/chat/completions", _chat(stream=True), 400, "stream=true is not supported"),
    ("/v1/chat/completions", _chat(n=2), 400, "n must be 1"),
    ("/v1/chat/completions", _chat(max_tokens=9), 400, "gateway.max_tokens 8"),
    ("/v1/chat/completions", _chat(max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", _chat(temperature=-1), 400, "temperature"),
    ("/v1/chat/completions", _chat(temperature=1e-300), 400, "use 0 for greedy"),
    ("/v1/chat/completions", _chat(presence_penalty=0.5), 400, "presence_penalty is not supported"),
    ("/v1/chat/completions", _chat(tool_choice="required"), 400, "tool_choice"),
    ("/v1/chat/completions", _chat(stop=["ab"]), 400, "only single-token stops"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function"}]), 400, "tools[0]"),
    ("/v1/chat/completions", {"messages": USER * 5}, 400, "gateway.max_messages is 4"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 80}]}, 400, "gateway.max_prompt_tokens is 64"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]}, 413, "gateway.max_body_bytes"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt is empty"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("/v1/tokens/generate", {"prompt_token_ids": [5, 100000]}, 400, "outside the vocabulary"),
    ("/v1/tokens/generate", {"prompt_token_ids": []}, 400, "prompt_token_ids"),
    ("/v1/tokens/generate", {"prompt_token_ids": [5], "bogus": 1}, 400, "bogus"),
    ("/rollouts", {"task": 3}, 400, "task"),
    ("/rollouts/x/finish", {}, 400, "reward"),
    ("/engines/register", {"engine_id": "", "address": "http://x"}, 400, "engine_id"),
    ("/nowhere", {}, 404, "Not Found"),
]


@pytest.mark.parametrize(("path", "body", "status", "fragment"), CASES, ids=[f"{c[0]}:{c[3]}" for c in CASES])
def test_malformed_requests_get_a_4xx_that_says_what_is_wrong(gateway, path, body, status, fragment) -> None:
    headers = {"Authorization": f"Bearer {gateway.key}", "Content-Type": "application/json"}
    if isinstance(body, bytes):
        response = gateway.http.post(path, content=body, headers=headers)
    else:
        response = gateway.http.post(path, json=body, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_a_chunked_body_over_the_limit_is_refused(gateway) -> None:
    chunks = (b'{"messages": [{"role": "user", "content": "' + b"x" * 1000 for _ in range(6))
    response = gateway.http.post("/v1/chat/completions", content=chunks, headers={"Authorization": f"Bearer {gateway.key}"})
    assert response.status_code == 413


def test_too_many_branches(gateway) -> None:
    _, key = gateway.open()
    client = gateway.openai(key)
    for i in range(2):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"v{i}"}])
    response = gateway.http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "v3"}]}, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code == 400 and "max_branches" in response.json()["error"]["message"]


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_generated_request_gets_a_5xx(gateway, mode) -> None:
    """Every operation of the gateway's OpenAPI schema, with schema-valid and schema-violating data,
    sent with a valid rollout key so generated requests reach rendering, routing and the engine.
    (Driven by hand: schemathesis' pytest plugin does not run under pytest 9.)"""
    schemathesis = pytest.importorskip("schemathesis")
    schema = schemathesis.openapi.from_url(gateway.url + "/openapi.json")
    server_errors = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy(schemathesis.GenerationMode(mode)))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            response = case.call(headers={"Authorization": f"Bearer {gateway.key}"}, timeout=30)
            if response.status_code >= 500:
                server_errors.append(f"{case.method} {case.path} {case.body!r}: {response.status_code} {response.text[:300]}")

        try:
            check()
        except Unsatisfiable:
            assert mode == "negative"  # an operation without inputs has no invalid ones (GET /health)
    assert not server_errors, "\n".join(server_errors[:5])
