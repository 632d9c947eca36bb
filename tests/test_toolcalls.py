"""Tool-call markup <-> OpenAI messages: parsing what the model wrote, rendering what agents send."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from asyncrl.gateway.toolcalls import (
    MARKERS,
    MessageError,
    parse_completion,
    parse_completion_text,
    to_template_messages,
    to_template_tools,
)
from asyncrl.policy.tokenizer import ASSISTANT, EOS, build_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}, "timeout": {"type": "integer"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def counter():
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def test_plain_text_strips_eos(tok) -> None:
    parsed = parse_completion(ids(tok, "42" + EOS), tok)
    assert (parsed.content, parsed.tool_calls, parsed.parse_error) == ("42", [], None)
    assert parsed.message() == {"role": "assistant", "content": "42"}
    assert parsed.finish_reason("stop") == "stop"


def test_one_call_with_content(tok) -> None:
    text = "Let me run it.<tool_call>python<arg_key>code</arg_key><arg_value>print(6*7)</arg_value></tool_call>" + EOS
    parsed = parse_completion(ids(tok, text), tok, new_id=counter())
    assert parsed.parse_error is None
    assert parsed.content == "Let me run it."
    assert parsed.tool_calls == [
        {"id": "call_0", "type": "function", "function": {"name": "python", "arguments": '{"code": "print(6*7)"}'}}
    ]
    assert parsed.finish_reason("stop") == "tool_calls"
    assert parsed.finish_reason("length") == "length"


def test_tool_call_only_reply_has_null_content(tok) -> None:
    text = "<tool_call>python<arg_key>code</arg_key><arg_value>1</arg_value></tool_call>" + EOS
    message = parse_completion(ids(tok, text), tok).message()
    assert message["content"] is None and len(message["tool_calls"]) == 1


def test_several_calls_whitespace_between_tags(tok) -> None:
    text = (
        "<tool_call> a \n<arg_key>x</arg_key>\n<arg_value> 1 </arg_value>\n</tool_call>\n"
        "<tool_call>b</tool_call>"  # no arguments, no EOS (finish_reason length)
    )
    parsed = parse_completion(ids(tok, text), tok, new_id=counter())
    assert parsed.parse_error is None and parsed.content == ""
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["a", "b"]
    assert [c["id"] for c in parsed.tool_calls] == ["call_0", "call_1"]
    # Values are verbatim (spaces kept); they are what the model wrote.
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"x": " 1 "}, {}]


def test_default_ids_are_unique(tok) -> None:
    text = "<tool_call>a</tool_call><tool_call>a</tool_call>"
    calls = parse_completion(ids(tok, text), tok).tool_calls
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]


def test_argument_types_follow_the_tool_schema(tok) -> None:
    def args(key: str, value: str, tools=TOOLS):
        text = f"<tool_call>python<arg_key>{key}</arg_key><arg_value>{value}</arg_value></tool_call>"
        return json.loads(parse_completion(ids(tok, text), tok, tools).tool_calls[0]["function"]["arguments"])

    assert args("timeout", "42") == {"timeout": 42}
    assert args("code", "42") == {"code": "42"}  # a string parameter stays a string
    assert args("other", "42") == {"other": "42"}  # unknown parameters are not guessed at
    assert args("timeout", "soon") == {"timeout": "soon"}  # undecodable: kept as written
    assert args("timeout", "42", tools=None) == {"timeout": "42"}


def test_keyless_json_arguments(tok) -> None:
    text = '<tool_call>python<arg_value>{"code": "x=1"}</arg_value></tool_call>'
    call = parse_completion(ids(tok, text), tok).tool_calls[0]
    assert json.loads(call["function"]["arguments"]) == {"code": "x=1"}


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>python<arg_key>code</arg_key><arg_value>print(1)",  # truncated mid-call
        "<tool_call>python<arg_key>code</arg_key><arg_value>1</arg_value>",  # unclosed tool_call
        "<tool_call><arg_key>code</arg_key><arg_value>1</arg_value></tool_call>",  # missing name
        "<tool_call>two words</tool_call>",
        "<tool_call>f</tool_call>and then some text",
        "before</arg_value>after",  # stray markup in the content
        "<tool_call>f<arg_key>k</arg_key>v</tool_call>",  # value not wrapped
        "<tool_call>f<arg_key>k</arg_key><arg_value>1</arg_value><arg_key>k</arg_key><arg_value>2</arg_value></tool_call>",
        "<tool_call>f<arg_value>[1, 2]</arg_value></tool_call>",  # keyless but not an object
        "<tool_call>f<tool_call>g</tool_call>",
    ],
)
def test_malformed_markup_is_content_with_an_error(tok, text: str) -> None:
    parsed = parse_completion(ids(tok, text + EOS), tok)
    assert parsed.tool_calls == []
    assert parsed.content == text  # everything the model wrote, EOS stripped
    assert parsed.parse_error
    assert parsed.message() == {"role": "assistant", "content": text}


def test_random_token_soup_never_raises(tok) -> None:
    rng = random.Random(0)
    vocab = [tok.convert_tokens_to_ids(m) for m in MARKERS] + ids(tok, "ab 1{}\n") + [tok.eos_token_id]
    for _ in range(300):
        soup = [rng.choice(vocab) for _ in range(rng.randint(0, 12))]
        parsed = parse_completion(soup, tok)
        assert isinstance(parsed.content, str)
        assert parsed.parse_error is None or parsed.tool_calls == []


def test_markup_spelled_in_characters_is_not_a_tool_call(tok) -> None:
    text = "<tool_call>f</tool_call>"
    by_char = [tok.convert_tokens_to_ids(c) for c in text]
    parsed = parse_completion(by_char, tok)
    assert (parsed.content, parsed.tool_calls, parsed.parse_error) == (text, [], None)
    assert parse_completion_text(text).tool_calls  # the text-only parser cannot tell them apart


def test_parsed_message_renders_back_to_the_sampled_tokens(tok) -> None:
    # What the gateway returns, echoed back by an agent and rendered, must be what the model sampled.
    sampled = (
        "Sure.<tool_call>python<arg_key>code</arg_key><arg_value>print(1)</arg_value>"
        "<arg_key>timeout</arg_key><arg_value>5</arg_value></tool_call>" + EOS
    )
    returned = parse_completion(ids(tok, sampled), tok, TOOLS).message()
    wire = json.loads(json.dumps(returned))  # through HTTP and back
    rendered = tok.apply_chat_template(to_template_messages([wire]), tokenize=False)
    assert rendered == ASSISTANT + sampled


def test_template_messages_from_openai_wire_format() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "6*"}, {"type": "text", "text": "7"}], "name": "u"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": "x", "c": [true]}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    assert to_template_messages(messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "6*7"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": "x", "c": [True]}}}],
        },
        {"role": "tool", "content": "42"},
    ]
    # Reasoning an agent echoes is passed on under both of transformers' names, wherever it was sent.
    for field in ("reasoning_content", "thinking", "reasoning"):
        (echoed,) = to_template_messages([{"role": "assistant", "content": "42", field: "6*7"}])
        assert echoed == {"thinking": "6*7", "role": "assistant", "content": "42", "reasoning_content": "6*7"}
    assert to_template_messages([{"role": "user", "content": "x", "reasoning_content": "r"}]) == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts"),
        ([{"role": "user", "content": "x", "tool_calls": [{}]}], "only assistant"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}], "tool_calls[0].function.arguments"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}], "JSON object"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "function.name"),
        ([{"role": "assistant", "tool_calls": "f"}], "must be a list"),
        ([{"role": "assistant", "content": "x", "reasoning_content": 7}], "messages[0].reasoning_content"),
    ],
)
def test_bad_messages_say_what_is_wrong(messages, fragment: str) -> None:
    with pytest.raises(MessageError, match=re.escape(fragment)):
        to_template_messages(messages)


def test_tools_validation() -> None:
    assert to_template_tools(None) is None and to_template_tools([]) is None
    assert to_template_tools(TOOLS) == TOOLS
    for bad in ("python", [{"type": "function"}], [{"type": "retrieval", "function": {"name": "f"}}]):
        with pytest.raises(MessageError, match="tools"):
            to_template_tools(bad)
