"""The Anthropic Messages API end to end with the official `anthropic` client: tool_use / tool_result round
trips, streaming events, thinking blocks, stop sequences, token counting, Claude Code's request shape, and
refusals in Anthropic's error shape; every call is recorded exactly as the equivalent chat completion is."""

from __future__ import annotations

import json

import anthropic
import pytest
from gateway_helpers import TOOLS, LiveGateway, make_engine, make_service, one_token_per_delta, scripted_model
from test_gateway_streaming import REASONED, TEXT_SCRIPT, USER, _bpe_gateway, _same_record, bpe  # noqa: F401  (bpe: a fixture)

from asyncrl.configs.schema import SamplingConfig
from asyncrl.gateway.store import open_store

ANTHROPIC_TOOLS = [{"name": "f", "description": "", "input_schema": TOOLS[0]["function"]["parameters"]}]


@pytest.fixture(scope="module")
def engines():
    tools, text = make_engine("tools"), make_engine("text", scripted_model(TEXT_SCRIPT))
    yield {"tools": tools, "text": text}
    tools.shutdown()
    text.shutdown()


@pytest.fixture
def gateway(engines, tmp_path):
    service = make_service(open_store(tmp_path), [engines["tools"]], sampling=SamplingConfig(max_tokens=16))
    with LiveGateway(service) as gw:
        yield gw


@pytest.fixture
def text_gateway(engines, tmp_path):
    with LiveGateway(make_service(open_store(tmp_path), [engines["text"]], sampling=SamplingConfig(max_tokens=16))) as gw:
        yield gw


def _client(gateway: LiveGateway, key: str, **options) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key=key, max_retries=0, timeout=60, **options)


def _turns(gateway: LiveGateway, rollout_id: str):
    return gateway.service.store.get(rollout_id).turns


def test_a_tool_round_trip_is_recorded_as_the_same_chat_completions(gateway) -> None:
    messages_id, key = gateway.open()
    chat_id, chat_key = gateway.open()
    client, chat = _client(gateway, key), gateway.openai(chat_key)
    history: list[dict] = [{"role": "user", "content": "go"}]
    chat_history: list[dict] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "go"}]
    for turn in range(2):
        reply = client.messages.create(
            model="claude-x", max_tokens=16, system="be brief", messages=history, tools=ANTHROPIC_TOOLS, extra_body={"seed": turn}
        )
        assert reply.stop_reason == "tool_use" and reply.model == "claude-x" and reply.role == "assistant"
        (use,) = [b for b in reply.content if b.type == "tool_use"]
        assert use.id.startswith("toolu_") and (use.name, use.input) == ("f", {"a": "7"})
        assert reply.usage.input_tokens == len(_turns(gateway, messages_id)[turn].prompt_token_ids)
        history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]}]
        history += [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "ok"}]}]

        answer = chat.chat.completions.create(model="p", messages=chat_history, tools=TOOLS, seed=turn, max_tokens=16).choices[0].message
        chat_history += [json.loads(answer.model_dump_json(exclude_none=True))]
        chat_history += [{"role": "tool", "tool_call_id": answer.tool_calls[0].id, "content": "ok"}]
    recorded, expected = _turns(gateway, messages_id), _turns(gateway, chat_id)
    assert [t.branch for t in recorded] == [0, 0]  # the second prompt extends the first turn's tokens
    for got, want in zip(recorded, expected, strict=True):
        _same_record(got, want)


def test_a_streamed_message_is_the_plain_one_in_events(gateway) -> None:
    plain_id, plain_key = gateway.open()
    streamed_id, streamed_key = gateway.open()
    asked = dict(model="m", max_tokens=16, messages=[{"role": "user", "content": "go"}], tools=ANTHROPIC_TOOLS)
    plain = _client(gateway, plain_key).messages.create(**asked)
    with _client(gateway, streamed_key).messages.stream(**asked) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "input_json" in events and "message_delta" in events
    assert [(b.type, b.name, b.input) for b in final.content] == [(b.type, b.name, b.input) for b in plain.content]
    assert (final.stop_reason, final.usage.output_tokens) == (plain.stop_reason, plain.usage.output_tokens)
    _same_record(_turns(gateway, plain_id)[0], _turns(gateway, streamed_id)[0])


def test_text_replies_stop_reasons_and_stop_sequences(engines, text_gateway) -> None:
    _, key = text_gateway.open()
    client = _client(text_gateway, key)
    done = client.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert [(b.type, b.text) for b in done.content] == [("text", "Hi, bot!")] and done.stop_reason == "end_turn"
    cut = client.messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "again"}])
    assert cut.content[0].text == "Hi," and cut.stop_reason == "max_tokens"
    stopped = client.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": "more"}], stop_sequences=[" "])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", " ")
    assert stopped.content[0].text == "Hi, "  # the stop token stays in the text, as the agent must echo what was sampled
    with (
        one_token_per_delta(engines["text"]),
        client.messages.stream(model="m", max_tokens=16, messages=[{"role": "user", "content": "hi again"}]) as stream,
    ):
        texts = [event.delta.text for event in stream if event.type == "content_block_delta"]
    assert "".join(texts) == "Hi, bot!" and len(texts) > 1  # sent as sampled, not at the end


def test_count_tokens_is_the_prompt_the_call_records(gateway) -> None:
    rollout_id, key = gateway.open()
    client = _client(gateway, key)
    asked = dict(
        model="m", system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}], messages=[{"role": "user", "content": "go"}]
    )
    counted = client.messages.count_tokens(**asked, tools=ANTHROPIC_TOOLS)
    client.messages.create(**asked, tools=ANTHROPIC_TOOLS, max_tokens=8)
    assert counted.input_tokens == len(_turns(gateway, rollout_id)[0].prompt_token_ids)


def test_thinking_blocks_carry_the_reasoning(bpe, tmp_path) -> None:  # noqa: F811
    live, _ = _bpe_gateway(tmp_path, bpe, REASONED, reasoning_parser="think")
    with live as gateway:
        _, key = gateway.open()
        client = _client(gateway, key)
        plain = client.messages.create(model="m", max_tokens=64, messages=USER, thinking={"type": "enabled", "budget_tokens": 1024})
        assert [b.type for b in plain.content] == ["thinking", "text"]
        assert plain.content[0].thinking == "Let me think about Paris."
        with client.messages.stream(model="m", max_tokens=64, messages=USER) as stream:
            deltas = [(e.delta.type, e.index) for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
        assert {kind for kind, _ in deltas} >= {"thinking_delta", "text_delta"}
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
            ("thinking", plain.content[0].thinking),
            ("text", plain.content[1].text),
        ]
        history = [*USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in plain.content]}]
        again = client.messages.create(model="m", max_tokens=8, messages=[*history, {"role": "user", "content": "and?"}])
        assert again.stop_reason == "max_tokens"  # a thinking block sent back is read


CLAUDE_CODE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,mid-conversation-system-2026-04-07",
    "x-app": "cli",
}


def _claude_code_body(history: list[dict]) -> dict:
    """The shape of Claude Code's requests (from a recorded call, trimmed): system blocks with cache_control,
    a mid-conversation system message, fields that change nothing, `$schema` in tool schemas, huge max_tokens."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **ANTHROPIC_TOOLS[0]["input_schema"]}
    cached = {"type": "ephemeral"}
    return {
        "model": "claude-opus-4-8", "max_tokens": 64000, "stream": True,
        "system": [{"type": "text", "text": "x-billing: v1;"}, {"type": "text", "text": "You are a CLI.", "cache_control": cached}],
        "messages": history, "tools": [{"name": "f", "description": "runs f", "input_schema": schema}],
        "metadata": {"user_id": json.dumps({"session_id": "s"})}, "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}, "output_config": {"effort": "high"},
    }  # fmt: skip


def test_claude_codes_requests_are_served_and_extend_each_other(gateway) -> None:
    rollout_id, key = gateway.open()
    first_user = {
        "role": "user",
        "content": [{"type": "text", "text": "<reminder>\n"}, {"type": "text", "text": "go", "cache_control": {}}],
    }
    history = [first_user, {"role": "system", "content": "Agents: none."}]
    headers = {**CLAUDE_CODE_HEADERS, "x-api-key": key}
    with gateway.http.stream("POST", "/v1/messages?beta=true", json=_claude_code_body(history), headers=headers) as response:
        assert response.status_code == 200, response.read()
        data = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    use = next(d["content_block"] for d in data if d["type"] == "content_block_start" and d["content_block"]["type"] == "tool_use")
    arguments = "".join(d["delta"]["partial_json"] for d in data if d["type"] == "content_block_delta")
    history[0]["content"][1].pop("cache_control")  # Claude Code moves the marker between turns
    history += [{"role": "assistant", "content": [{**use, "input": json.loads(arguments)}]}]
    result = {"type": "tool_result", "tool_use_id": use["id"], "content": "7", "is_error": False, "cache_control": {"type": "ephemeral"}}
    history += [{"role": "user", "content": [result]}]
    bearer = {**CLAUDE_CODE_HEADERS, "Authorization": f"Bearer {key}"}  # ANTHROPIC_AUTH_TOKEN's way
    second = gateway.http.post("/v1/messages?beta=true", json={**_claude_code_body(history), "stream": False}, headers=bearer)
    assert second.status_code == 200, second.text
    turns = _turns(gateway, rollout_id)
    assert [t.branch for t in turns] == [0, 0]
    assert turns[1].prompt_token_ids[: len(turns[0].prompt_token_ids) + len(turns[0].completion_token_ids)] == (
        turns[0].prompt_token_ids + turns[0].completion_token_ids
    )


# fmt: off
ERRORS = [
    ({"max_tokens": 8, "messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "messages[0].content[0]"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"text": "x"}]}]}, 400, "messages[0].content[0].type"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].content[0].text"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]}, 400, "tool_use_id"),
    (
        {
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}}]},
                {"role": "user", "content": "no result"},
            ],
        },
        400,
        "have no tool_result",
    ),
    (
        {
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "f", "input": "{}"}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a"}]},
            ],
        },
        400,
        "messages[1].content[0].input",
    ),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "pre"}]}, 400, "prefilling"),
    ({"max_tokens": 8, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "w"}]}, 400, "tools[0].type"),
    ({"max_tokens": 8, "messages": USER, "tools": [{"name": "f"}]}, 400, "tools[0].input_schema"),
    ({"max_tokens": 8, "messages": USER, "tool_choice": {"type": "any"}}, 400, "tool_choice.type 'any'"),
    ({"max_tokens": 8, "messages": USER, "thinking": {"type": "sometimes"}}, 400, "thinking.type"),
    ({"max_tokens": 8, "messages": USER, "stop_sequences": ["two words"]}, 400, "single-token stops"),
    ({"max_tokens": 8, "messages": USER, "system": [{"type": "image"}]}, 400, "system[0]"),
    ({"max_tokens": 8, "messages": USER, "stream": "maybe"}, 400, "stream"),
    ({"max_tokens": 8, "messages": USER, "temperature": 0.5}, 400, "temperature"),
]
# fmt: on


@pytest.mark.parametrize(("body", "status", "fragment"), ERRORS, ids=[e[2] for e in ERRORS])
def test_refusals_come_in_anthropics_error_shape(gateway, body, status, fragment) -> None:
    _, key = gateway.open()
    response = gateway.http.post("/v1/messages", json=body, headers={"x-api-key": key})
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert fragment in error["error"]["message"]
    assert response.headers["x-should-retry"] == "false"


def test_keys_and_ended_rollouts_are_refused_with_the_sdks_errors(gateway) -> None:
    rollout_id, key = gateway.open()
    with pytest.raises(anthropic.AuthenticationError) as missing:
        anthropic.Anthropic(base_url=gateway.url, api_key="nope", max_retries=0).messages.create(model="m", max_tokens=8, messages=USER)
    assert missing.value.body["error"]["type"] == "authentication_error"
    gateway.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": 0.0}).raise_for_status()
    for stream in (False, True):
        with pytest.raises(anthropic.ConflictError) as ended:
            if stream:
                with _client(gateway, key).messages.stream(model="m", max_tokens=8, messages=USER) as events:
                    list(events)
            else:
                _client(gateway, key).messages.create(model="m", max_tokens=8, messages=USER)
        assert "takes no more calls" in ended.value.body["error"]["message"]
    assert _client(gateway, gateway.open()[1]).messages.create(model="m", max_tokens=16, messages=USER).stop_reason == "tool_use"
