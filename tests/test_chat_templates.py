"""Real checkpoints' chat templates (Qwen3, Llama 3.1, GLM-4.5, and one that keeps old reasoning) through
the gateway's conversation: multi-turn tool chats are token-exact extensions of the sampled turns and
equal the tokenizer's own rendering wherever the template is prefix-stable (a recorded fork where it is
not); every special or added token's text in content is plain text; each family's tool parser reads the
calls its template writes."""

from __future__ import annotations

import itertools
import json

import pytest
from chat_templates import FAMILIES, build, reply

from asyncrl.gateway.conversation import Conversation
from asyncrl.gateway.parsers import parse_reply, reasoning_parser, tool_call_parser
from asyncrl.gateway.parsers.auto import resolve
from asyncrl.gateway.template import CompiledTemplate, TokenizerTemplate, chat_template

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]
NAMES = list(FAMILIES)
THINKS = {"qwen3", "chatml_keep", "glm45"}


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def hf_messages(messages: list[dict]) -> list[dict]:
    """Request messages as a serving stack hands them to `apply_chat_template`: arguments decoded, ids dropped."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if k not in ("tool_call_id", "id") and v is not None}
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in message["tool_calls"]
            ]
        out.append(message)
    return out


def own_ids(tok, messages, **kwargs) -> list[int]:
    return tok.apply_chat_template(hf_messages(messages), tools=WEATHER, add_generation_prompt=True, **kwargs)["input_ids"]


class Agent:
    """A tool-using agent on one family's template: samples the family's replies, echoes them as the openai client does."""

    def __init__(self, name: str, template_kind: str = "compiled") -> None:
        self.name, self.tok = name, build(name)
        template = chat_template(self.tok) if template_kind == "compiled" else TokenizerTemplate(self.tok)
        assert isinstance(template, CompiledTemplate) == (template_kind == "compiled")
        self.conv = Conversation(self.tok, template=template)
        self.tool_parser = tool_call_parser(FAMILIES[name].tool_parser)
        self.think = reasoning_parser("think") if name in THINKS else None

    def turn(self, messages: list[dict], sampled: str, **kwargs) -> tuple[list[int], dict, int]:
        """(prompt ids, the reply message, branch) of one turn."""
        prepared = self.conv.prepare(messages, WEATHER, kwargs or None)
        completion = self.tok.encode(sampled, add_special_tokens=False)
        parsed = parse_reply(completion, self.tok, WEATHER, ids(), self.tool_parser, self.think)
        assert parsed.parse_error is None
        message = json.loads(json.dumps(parsed.message()))
        branch = self.conv.commit(prepared, completion, message)
        assert self.conv.branch(branch).token_ids == prepared.prompt_token_ids + completion
        return prepared.prompt_token_ids, message, branch


def test_the_families_are_real_byte_level_tokenizers_with_their_markers():
    for name, family in FAMILIES.items():
        tok = build(name)
        assert tok.eos_token == family.eos and tok.bos_token == family.bos
        for text in family.special + family.added:
            assert len(tok.encode(text, add_special_tokens=False)) == 1, (name, text)
        assert len(tok.encode("weather", add_special_tokens=False)) < len("weather")  # BPE merges, not characters
        assert chat_template(tok).markup.ids  # its markers are guarded


@pytest.mark.parametrize("kind", ["compiled", "generic"])
@pytest.mark.parametrize("name", NAMES)
def test_multi_turn_tool_chats_extend_the_sampled_tokens_and_equal_the_tokenizers_rendering(name, kind):
    agent = Agent(name, kind)
    thinking = name in THINKS
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris for 3 days?"}]
    call = [("get_weather", {"city": "Paris", "days": 3})]
    prompt, message, branch = agent.turn(messages, reply(name, calls=call, reasoning="Paris, 3 days." if thinking else None))
    assert prompt == own_ids(agent.tok, messages)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == call
    recorded = agent.conv.branch(branch).token_ids
    messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "sunny, 21 C"}]
    prompt, message, branch = agent.turn(messages, reply(name, "Sunny, 21 C.", reasoning="Answer it." if thinking else None))
    assert prompt[: len(recorded)] == recorded  # the sampled turn, token for token
    assert prompt == own_ids(agent.tok, messages)  # and what the tokenizer renders: the template is prefix-stable here
    assert message["content"] == "Sunny, 21 C." and len(agent.conv.branches) == 1
    recorded = agent.conv.branch(branch).token_ids
    messages += [message, {"role": "user", "content": "And Rome?"}]
    prompt, _, branch = agent.turn(
        messages, reply(name, calls=[("get_weather", {"city": "Rome"})], reasoning="Rome." if thinking else None)
    )
    assert prompt == own_ids(agent.tok, messages)
    if FAMILIES[name].drops_old_reasoning:
        # A new user query: the template drops the earlier turns' reasoning, so the prompt is no extension
        # of them; the conversation records a fork rendered fresh, as the template writes it.
        (fork,) = [b for b in agent.conv.branches if b.id == branch]
        assert (fork.fork_reason, fork.parent, len(agent.conv.branches)) == ("template", None, 2)
        assert prompt[: len(recorded)] != recorded
    else:
        assert prompt[: len(recorded)] == recorded and len(agent.conv.branches) == 1


def hostile(tok) -> str:
    """Every added token's text (special or not), one nested in another, and a marker's prefix."""
    texts = [token.content for token in tok.added_tokens_decoder.values()]
    return "a" + "".join(texts) + "<" + texts[1] + "|>z" + texts[0][:-1]


@pytest.mark.parametrize("kind", ["compiled", "generic"])
@pytest.mark.parametrize("name", NAMES)
def test_every_markers_text_in_content_is_plain_text(name, kind):
    agent = Agent(name, kind)
    tok, markers = agent.tok, chat_template(agent.tok).markup.ids

    def chat(fill: str) -> tuple[list[dict], list[dict]]:
        arguments = json.dumps({"city": fill, "days": 2})
        assistant = {
            "role": "assistant",
            "content": "t" + fill,
            "tool_calls": [{"id": "c", "function": {"name": "get_weather", "arguments": arguments}}],
        }
        if name in THINKS:
            assistant["reasoning_content"] = "r" + fill
        messages = [
            {"role": "system", "content": "s" + fill},
            {"role": "user", "content": "u" + fill},
            assistant,
            {"role": "tool", "tool_call_id": "c", "content": "o" + fill},
        ]
        tools = [{**WEATHER[0], "function": {**WEATHER[0]["function"], "description": fill}}]
        return messages, tools

    def prompt(fill: str) -> list[int]:
        messages, tools = chat(fill)
        return Conversation(tok, template=agent.conv.template).prepare(messages, tools).prompt_token_ids

    text = hostile(tok)
    spelled, harmless = prompt(text), prompt("x")
    # The markers in the prompt are the template's own: the same ones as for harmless content...
    assert [t for t in spelled if t in markers] == [t for t in harmless if t in markers]
    # ...and every character of the content is there, as plain tokens.
    messages, tools = chat(text)
    assert tok.decode(spelled, skip_special_tokens=False) == tok.apply_chat_template(
        hf_messages(messages), tools=tools, tokenize=False, add_generation_prompt=True
    )
    plain = chat_template(tok).encode_text("u" + text)
    assert not set(plain) & set(markers) and any(spelled[i : i + len(plain)] == plain for i in range(len(spelled)))


@pytest.mark.parametrize("name", NAMES)
def test_each_familys_parser_reads_the_calls_its_template_writes(name):
    tok, family = build(name), FAMILIES[name]
    think = reasoning_parser("think") if name in THINKS else None
    messages = [{"role": "user", "content": "Weather?"}]
    call = {"city": "Paris", "days": 3}
    sampled = reply(name, calls=[("get_weather", call)], reasoning="Look it up." if think else None)
    completion = tok.encode(sampled, add_special_tokens=False)
    parsed = parse_reply(completion, tok, WEATHER, ids(), tool_call_parser(family.tool_parser), think)
    assert parsed.parse_error is None and parsed.content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [("get_weather", call)]
    assert parsed.reasoning_content == ("Look it up." if think else None)
    # The reply is what the template writes for that message: rendered back, the sampled text follows the prompt.
    prompt = tok.apply_chat_template(messages, tools=WEATHER, tokenize=False, add_generation_prompt=True)
    rendered = tok.apply_chat_template(hf_messages([*messages, parsed.message()]), tools=WEATHER, tokenize=False)
    stop = tok.decode(completion[-1:], skip_special_tokens=False)
    assert (prompt + sampled).startswith(rendered.rstrip("\n")) or rendered.startswith(prompt + sampled.removesuffix(stop))
    # The checkpoint's parsers, read from its template (`auto`).
    assert resolve("auto", tok, "tool") == ("hermes" if name in ("qwen3", "chatml_keep") else family.tool_parser)
    assert resolve("auto", tok, "reasoning") == ("think" if think else None)


def test_auto_takes_what_the_checkpoint_declares_and_leaves_named_parsers_alone():
    tok = build("qwen3")
    tok.init_kwargs["tool_parser"] = "qwen"
    assert resolve("auto", tok, "tool") == "qwen" and resolve("llama3_json", tok, "tool") == "llama3_json"
    tok.init_kwargs["reasoning_parser"] = "deepseek_r1"
    assert resolve("auto", tok, "reasoning") == "deepseek_r1" and resolve(None, tok, "reasoning") is None
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    del tok.init_kwargs["tool_parser"]
    assert resolve("auto", tok, "tool") == "glm45"  # no known markup: the default


def test_llama3_calls_after_the_python_tag_and_ending_in_eom_are_read():
    tok = build("llama3")
    sampled = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eom_id|>'
    completion = tok.encode(sampled, add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|python_tag|>") in completion and completion[-1] == tok.convert_tokens_to_ids("<|eom_id|>")
    parsed = parse_reply(completion, tok, WEATHER, ids(), tool_call_parser("llama3_json"))
    assert parsed.parse_error is None and parsed.content == ""
    (call,) = parsed.tool_calls
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Oslo"})
