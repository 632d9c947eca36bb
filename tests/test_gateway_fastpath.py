"""The gateway's hot path gives what the generic path gives: `CompiledTemplate` renders and encodes
exactly as the tokenizer's own calls, and a `LeanJSONRoute` keeps FastAPI's schema and refusals."""

from __future__ import annotations

import json
import random

import pytest
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from gateway_helpers import TOKENIZER, make_service

from asyncrl.gateway import api
from asyncrl.gateway.app import create_app
from asyncrl.gateway.lean_route import LeanJSONRoute, rollout_key
from asyncrl.gateway.store import open_store
from asyncrl.gateway.template import CompiledTemplate, TokenizerTemplate, chat_template
from asyncrl.gateway.toolcalls import to_template_messages, to_template_tools
from asyncrl.policy.tokenizer import EOS, TOOL_CALL_OPEN, build_tokenizer

# A ChatML-style template that reads the special-token variables and serialises tools with tojson,
# beside the embedded GLM-style one: both paths must hand templates the same variables.
CHATML = (
    "{%- if tools %}{{ eos_token }}tools={{ tools | tojson }}\n{% endif -%}"
    "{%- for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}[{{ c.function.name }}:{{ c.function.arguments | tojson }}]{% endfor %}"
    "{{ pad_token }}\n{% endfor -%}{%- if add_generation_prompt %}<assistant>{% endif %}"
)
TEXTS = ["", "plain", "ünïcödé ✓ and\nnewlines", EOS + "x" + TOOL_CALL_OPEN, "  spaced  ", "{json: [1, 2]}"]


def _conversation(rng: random.Random) -> tuple[list[dict], list[dict] | None]:
    messages: list[dict] = [{"role": rng.choice(["system", "developer", "user"]), "content": rng.choice(TEXTS[1:])}]
    for _ in range(rng.randrange(0, 5)):
        arguments = {"code": rng.choice(TEXTS), "n": rng.randrange(100)}
        call = {"id": "c", "type": "function", "function": {"name": "python", "arguments": json.dumps(arguments)}}
        messages += [
            {"role": "assistant", "content": rng.choice([None, "", "let me check"]), "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": rng.choice(TEXTS)},
            {"role": "user", "content": [{"type": "text", "text": rng.choice(TEXTS)}]},
        ]
    tools = [{"type": "function", "function": {"name": "python", "description": None, "parameters": {"type": "object"}}}]
    return messages, rng.choice([None, tools])


@pytest.mark.parametrize("template", [None, CHATML], ids=["embedded", "chatml"])
def test_compiled_template_renders_and_encodes_as_the_tokenizer(template) -> None:
    tokenizer = build_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    fast, reference = chat_template(tokenizer), TokenizerTemplate(tokenizer)
    assert isinstance(fast, CompiledTemplate)
    rng = random.Random(0)
    for _ in range(200):
        raw, raw_tools = _conversation(rng)
        messages, tools = to_template_messages(raw), to_template_tools(raw_tools)
        for prompt in (True, False):
            text = fast.render(messages, tools, generation_prompt=prompt)
            assert text == reference.render(messages, tools, generation_prompt=prompt)
            assert fast.encode(text) == reference.encode(text)


def test_compiled_template_follows_a_replaced_template_and_a_truncating_backend() -> None:
    tokenizer = build_tokenizer()
    fast = chat_template(tokenizer)
    messages = [{"role": "user", "content": "hello there"}]
    before = fast.render(messages, None, generation_prompt=True)
    tokenizer.chat_template = CHATML
    assert (
        fast.render(messages, None, generation_prompt=True)
        == TokenizerTemplate(tokenizer).render(messages, None, generation_prompt=True)
        != before
    )
    # Another caller left truncation on the shared Rust tokenizer: the full text is still encoded.
    tokenizer._tokenizer.enable_truncation(4)
    assert fast.encode("hello there") == tokenizer.encode("hello there", add_special_tokens=False) and len(fast.encode("hello there")) == 11


def test_tokenizers_it_cannot_vouch_for_use_their_own_calls() -> None:
    class Wrapped:  # e.g. a test double that counts calls: its own methods must be the ones called
        def __getattr__(self, name):
            return getattr(TOKENIZER, name)

    assert type(chat_template(Wrapped())) is TokenizerTemplate
    assert type(chat_template(TOKENIZER)) is CompiledTemplate


def test_a_lean_route_documents_its_body_and_key_like_any_fastapi_route(tmp_path) -> None:
    app = create_app(make_service(open_store(tmp_path / "s.db"), []), heartbeats=False)
    schema = app.openapi()
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest")):
        operation = schema["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert operation["security"] == [{"HTTPBearer": []}]
        assert model in schema["components"]["schemas"]


def test_a_lean_route_refuses_what_fastapi_refuses(tmp_path) -> None:
    service = make_service(open_store(tmp_path / "s.db"), [], max_body_bytes=4096)
    client = TestClient(create_app(service, heartbeats=False))
    refusals = [
        ({"content": b'{"messages": [{"role": "user", "content": "hi"}]}', "headers": {"content-type": "text/plain"}}, 400, "Content-Type"),
        ({"content": b"", "headers": {"content-type": "application/json"}}, 400, "JSON"),
        ({"json": {"messages": []}}, 400, "messages"),
        ({"json": {"messages": [{"role": "user", "content": "hi"}]}}, 401, "Authorization"),
        ({"json": {"messages": [{"role": "user", "content": "x" * 5000}]}}, 413, "max_body_bytes"),
    ]
    for request, status, fragment in refusals:
        response = client.post("/v1/chat/completions", **request)
        assert response.status_code == status, response.text
        assert fragment in response.json()["error"]["message"]
    assert client.get("/v1/chat/completions").status_code == 405


def test_a_lean_route_refuses_an_endpoint_it_would_call_wrongly() -> None:
    async def extra_parameter(request: api.ChatCompletionRequest, user: str, key: str | None = Depends(rollout_key)) -> JSONResponse:
        return JSONResponse({})

    with pytest.raises(TypeError, match="must take"):
        FastAPI().router.add_api_route("/x", extra_parameter, methods=["POST"], route_class_override=LeanJSONRoute)
