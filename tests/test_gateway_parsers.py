"""Tool-call and reasoning parsers (gateway/parsers/): each named built-in reads its model family's
markup into OpenAI tool calls, never raises on what a model wrote (bad markup comes back as content with
`parse_error`), splits `<think>` sections off on token boundaries, and is found through the same
registry a config uses, as is a plug-in by import path."""

from __future__ import annotations

import itertools
import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from asyncrl.gateway.parsers import ParserNotFound, parse_reply, reasoning_parser, tool_call_parser
from asyncrl.gateway.parsers.base import ReasoningParser, ToolCallParser
from asyncrl.policy.tokenizer import (
    ARG_KEY_CLOSE,
    ARG_KEY_OPEN,
    ARG_VALUE_CLOSE,
    ARG_VALUE_OPEN,
    EOS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    build_tokenizer,
)

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def calls(parsed) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


def byte_level_bpe(added: list[str]) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer (GPT-2 style, as Qwen's is) with `added` as added tokens."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = ["Let me think about the weather in Paris for 3 days.", '{"name": "get_weather", "arguments": {"city": "Paris"}}']
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    core.train_from_iterator(corpus * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>")
    tokenizer.add_tokens(added)
    return tokenizer


@pytest.fixture(scope="module")
def bpe() -> PreTrainedTokenizerFast:
    """Thinking and tool tags as added tokens, as Qwen3's are."""
    return byte_level_bpe(["<think>", "</think>", "<tool_call>", "</tool_call>"])


def test_hermes_reads_json_blocks_after_the_content_and_flags_bad_ones():
    parser = tool_call_parser("hermes")
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
    text += '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>'
    parsed = parser.parse_text(text, WEATHER, ids())
    assert parsed.parse_error is None and parsed.content == "Checking."
    assert calls(parsed) == [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome"})]
    assert [c["id"] for c in parsed.tool_calls] == ["call_0", "call_1"]
    assert parsed.message()["content"] == "Checking." and parsed.finish_reason("stop") == "tool_calls"
    for bad, why in [
        ('<tool_call>{"name": "get_weather", "arguments": {</tool_call>', "not JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "string 'name'"),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "not an object"),
        ('<tool_call>{"name": "f"}', "unclosed"),
        ('<tool_call>{"name": "f"}</tool_call> and more', "text after"),
        ("no call here </tool_call>", "outside a tool call"),
    ]:
        parsed = parser.parse_text(bad, WEATHER, ids())
        assert parsed.tool_calls == [] and parsed.content == bad and why in parsed.parse_error, bad
    assert parser.parse_text("just words", None, ids()).parse_error is None
    assert tool_call_parser("qwen").parse_text(text, WEATHER, ids()).tool_calls  # the same format by Qwen's name


def test_llama3_json_reads_a_reply_that_is_the_calls():
    parser = tool_call_parser("llama3_json")
    one = parser.parse_text('{"name": "get_weather", "parameters": {"city": "Oslo"}}', WEATHER, ids())
    assert (one.content, calls(one), one.parse_error) == ("", [("get_weather", {"city": "Oslo"})], None)
    two = parser.parse_text('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', None, ids())
    assert calls(two) == [("a", {}), ("b", {"x": 1})]
    prose = parser.parse_text("It is sunny in Oslo.", WEATHER, ids())
    assert (prose.content, prose.tool_calls, prose.parse_error) == ("It is sunny in Oslo.", [], None)
    broken = parser.parse_text('{"name": "a", "parameters": {} trailing', None, ids())
    assert broken.tool_calls == [] and broken.parse_error and broken.content.startswith('{"name"')


def test_glm45_reads_xml_style_arguments_typed_by_the_schema_with_or_without_newlines():
    parser = tool_call_parser("glm45")
    glm45 = "Let me look.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
    glm45 += "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    parsed = parser.parse_text(glm45, WEATHER, ids())
    assert parsed.content == "Let me look." and calls(parsed) == [("get_weather", {"city": "Beijing", "days": 3})]
    # The tiny policy's tags are single tokens: read by id, and spelled-out tags are not a call.
    tokenizer = build_tokenizer()
    sampled = f"{TOOL_CALL_OPEN}get_weather{ARG_KEY_OPEN}city{ARG_KEY_CLOSE}{ARG_VALUE_OPEN}42{ARG_VALUE_CLOSE}{TOOL_CALL_CLOSE}{EOS}"
    by_id = parser.parse(tokenizer.encode(sampled, add_special_tokens=False), tokenizer, WEATHER, ids())
    assert calls(by_id) == [("get_weather", {"city": "42"})]  # a string parameter stays a string


def test_think_splits_reasoning_on_the_token_boundary_and_keeps_the_rest_exact(bpe):
    think, hermes = reasoning_parser("think"), tool_call_parser("hermes")
    reply = '<think>\nThe weather in Paris.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    token_ids = [*bpe.encode(reply, add_special_tokens=False), bpe.eos_token_id]
    reasoning, rest = think.split(token_ids, bpe)
    assert reasoning == "The weather in Paris." and isinstance(rest, list)
    assert rest == token_ids[token_ids.index(bpe.convert_tokens_to_ids("</think>")) + 1 :]  # exact tokens, not re-encoded
    parsed = parse_reply(token_ids, bpe, WEATHER, ids(), hermes, think)
    assert parsed.reasoning_content == "The weather in Paris." and parsed.content == ""
    assert calls(parsed) == [("get_weather", {"city": "Paris"})] and parsed.message()["reasoning_content"] == "The weather in Paris."
    # Opened by the template (only </think> sampled), cut off while thinking, or no thinking at all.
    assert (
        parse_reply(bpe.encode("think hard</think>\n\nParis", add_special_tokens=False), bpe, None, ids(), hermes, think).content == "Paris"
    )
    cut = parse_reply(bpe.encode("<think>still thinking", add_special_tokens=False), bpe, None, ids(), hermes, think)
    assert (cut.reasoning_content, cut.content) == ("still thinking", "")
    plain = parse_reply(bpe.encode("Paris", add_special_tokens=False), bpe, None, ids(), hermes, think)
    assert (plain.reasoning_content, plain.content) == (None, "Paris") and "reasoning_content" not in plain.message()


def test_where_the_tag_is_one_token_only_that_token_closes_the_thinking(bpe):
    # The characters of "</think>" sampled as plain tokens are content: the text is not searched.
    spelled = [*bpe.encode("a b", add_special_tokens=False), *bpe.encode("</", add_special_tokens=False)]
    spelled += bpe.encode("think>7", add_special_tokens=False)
    assert bpe.convert_tokens_to_ids("</think>") not in spelled and bpe.decode(spelled) == "a b</think>7"
    assert reasoning_parser("think").split(spelled, bpe) == (None, spelled)
    parsed = parse_reply(spelled, bpe, None, ids(), tool_call_parser("hermes"), reasoning_parser("think"))
    assert (parsed.reasoning_content, parsed.content) == (None, "a b</think>7")
    # Opened with the token and cut off: all of it is reasoning; "<think>" spelled out opens nothing.
    opened = [*bpe.encode(" <think>", add_special_tokens=False), *bpe.encode("hmm", add_special_tokens=False)]
    assert reasoning_parser("think").split(opened, bpe) == ("hmm", "")
    spelled_open = [*bpe.encode("<", add_special_tokens=False), *bpe.encode("think>hmm", add_special_tokens=False)]
    assert reasoning_parser("think").split(spelled_open, bpe) == (None, spelled_open)


def test_think_splits_on_text_where_the_tag_is_no_single_token():
    tokenizer = byte_level_bpe([])  # "</think>" is several byte-level tokens here
    assert len(tokenizer.encode("</think>", add_special_tokens=False)) > 1
    token_ids = tokenizer.encode("<think>a b</think>\n7", add_special_tokens=False)
    assert reasoning_parser("think").split(token_ids, tokenizer) == ("a b", "\n7")
    parsed = parse_reply(token_ids, tokenizer, None, ids(), tool_call_parser("hermes"), reasoning_parser("think"))
    assert (parsed.reasoning_content, parsed.content) == ("a b", "7")


class UpperParser:
    """A plug-in parser of the tests' own: no calls, content upper-cased."""

    def parse(self, token_ids, tokenizer, tools, new_id):
        return self.parse_text(tokenizer.decode(token_ids), tools, new_id)

    def parse_text(self, text, tools, new_id):
        from asyncrl.gateway.toolcalls import ParsedCompletion

        return ParsedCompletion(text.upper())


def test_parsers_are_found_by_name_or_import_path_and_unknown_names_list_the_known():
    assert isinstance(tool_call_parser("test_gateway_parsers:UpperParser"), ToolCallParser)
    assert tool_call_parser("test_gateway_parsers:UpperParser").parse_text("hi", None, ids()).content == "HI"
    assert isinstance(reasoning_parser("think"), ReasoningParser)
    with pytest.raises(ParserNotFound, match="known: glm45, hermes, llama3_json, qwen"):
        tool_call_parser("mistral")
    with pytest.raises(ParserNotFound, match="known: think"):
        reasoning_parser("deepseek")
    with pytest.raises(ParserNotFound, match="has no split method"):
        reasoning_parser("test_gateway_parsers:UpperParser")
    with pytest.raises(ParserNotFound, match="cannot import module"):
        tool_call_parser("no_such_module:Parser")


class OneCall:
    """An environment that makes one chat call and keeps the reply."""

    name = "one_call"

    def sample_task(self, rng, split="train"):
        return None

    async def run_episode(self, task, client):
        from asyncrl.envs.base import EpisodeResult

        self.reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "6*7?"}], max_tokens=32)
        return EpisodeResult(0.0)


def gateway_reply(sampled: str, **gateway):
    """(the reply message, the completion token IDs the engine sampled) of one call through the real gateway."""
    import asyncio

    from gateway_helpers import ScriptedEngine

    from asyncrl.configs.schema import RunConfig
    from asyncrl.envs.runner import run_recorded_episode
    from asyncrl.gateway.serving import evaluation_gateway

    tokenizer, env = build_tokenizer(), OneCall()
    engine = ScriptedEngine(lambda _prompt: sampled)

    async def go():
        async with evaluation_gateway(RunConfig(gateway=gateway), [engine], tokenizer) as served:
            await run_recorded_episode(env, None, served, sandboxes=None, evaluation=True)

    asyncio.run(go())
    return env.reply.choices[0].message, env.reply


def test_the_gateway_answers_with_the_runs_parsers():
    sampled = f"<think>six sevens</think>42{EOS}"
    message, reply = gateway_reply(sampled, reasoning_parser="think")
    assert (message.content, message.reasoning_content) == ("42", "six sevens")
    assert reply.usage.completion_tokens == len(build_tokenizer().encode(sampled, add_special_tokens=False))  # all of it sampled
    plain, _ = gateway_reply(sampled)  # no reasoning parser (the default): the thinking stays in the content
    assert plain.content == "<think>six sevens</think>42" and getattr(plain, "reasoning_content", None) is None
    with pytest.raises(ValueError, match="gateway: unknown tool-call parser 'mistral'; known: glm45"):
        gateway_reply("42", tool_parser="mistral")
