"""Thinking modes through the gateway's conversation, on templates that drop old reasoning (Qwen3, GLM-4.5)
and one that keeps it: thinking switched per request (`chat_template_kwargs.enable_thinking`,
`reasoning_effort`), interleaved thinking between tool calls, reasoning preserved or dropped across user
turns. Every prompt is the sampled tokens extended, or a recorded fork where the template rewrote earlier
turns; kwargs a template does not read are refused, naming the field; end to end with the openai client."""

from __future__ import annotations

import json
import math

import pytest
from chat_templates import FAMILIES, QWEN3_TEMPLATE, build, reply
from test_chat_templates import WEATHER, Agent, own_ids

from asyncrl.configs.schema import GatewayConfig, SamplingConfig
from asyncrl.gateway.conversation import Conversation
from asyncrl.gateway.toolcalls import MessageError
from asyncrl.records import GenerationResult

QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
PARIS = [("get_weather", {"city": "Paris"})]


def tool_result(message: dict, content: str = "sunny") -> dict:
    return {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": content}


def branch_of(agent: Agent, branch_id: int):
    return next(b for b in agent.conv.branches if b.id == branch_id)


@pytest.mark.parametrize("name", ["qwen3", "chatml_keep"])
def test_thinking_switched_off_for_one_request_extends_the_branch(name):
    # ChatML's switch writes an empty think section into the generation prompt only: the turns before are
    # rendered as they were sampled, so the turn extends the branch token for token.
    agent = Agent(name)
    _, message, branch = agent.turn(QUESTION, reply(name, calls=PARIS, reasoning="Call the tool."))
    recorded = agent.conv.branch(branch).token_ids
    messages = [*QUESTION, message, tool_result(message)]
    prompt, message, branch = agent.turn(messages, reply(name, "Sunny."), enable_thinking=False)
    assert prompt[: len(recorded)] == recorded and prompt == own_ids(agent.tok, messages, enable_thinking=False)
    assert agent.tok.decode(prompt[len(recorded) :]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert (message["content"], "reasoning_content" in message, len(agent.conv.branches)) == ("Sunny.", False, 1)
    # Back on (explicitly) for a new query: neither template renders the empty think section the switch
    # wrote into that turn's prompt, so that reply is rewritten and the trajectory forks.
    recorded = agent.conv.branch(branch).token_ids
    messages += [message, {"role": "user", "content": "Thanks!"}]
    prompt, _, branch = agent.turn(messages, reply(name, "Welcome.", reasoning="Polite."), enable_thinking=True)
    assert prompt == own_ids(agent.tok, messages, enable_thinking=True)
    assert branch_of(agent, branch).fork_reason == "template" and prompt[: len(recorded)] != recorded
    assert ("Call the tool." in agent.tok.decode(prompt)) == (not FAMILIES[name].drops_old_reasoning)


def test_glm_thinking_off_rewrites_earlier_user_turns_so_the_trajectory_forks():
    # GLM-4.5 appends /nothink to every user turn when thinking is off: the tokens sampled under the
    # default render must not be reused for a request that renders them otherwise.
    agent = Agent("glm45")
    _, message, _ = agent.turn(QUESTION, reply("glm45", calls=PARIS, reasoning="Call the tool."))
    messages = [*QUESTION, message, tool_result(message)]
    prompt, message, branch = agent.turn(messages, reply("glm45", calls=[("get_weather", {"city": "Rome"})]), enable_thinking=False)
    assert prompt == own_ids(agent.tok, messages, enable_thinking=False)
    fork = branch_of(agent, branch)
    assert (fork.fork_reason, fork.parent, len(agent.conv.branches)) == ("template", None, 2)
    assert agent.tok.decode(prompt).count("/nothink") == 1 and agent.tok.decode(prompt).endswith("<|assistant|>\n<think></think>")
    # The same switch on the next request renders those turns as before, so that branch goes on.
    recorded = fork.token_ids
    messages += [message, tool_result(message)]
    prompt, _, branch = agent.turn(messages, reply("glm45", "Sunny in both."), enable_thinking=False)
    assert (branch, prompt[: len(recorded)]) == (fork.id, recorded) and prompt == own_ids(agent.tok, messages, enable_thinking=False)


@pytest.mark.parametrize("name", ["qwen3", "glm45", "chatml_keep"])
def test_interleaved_thinking_between_tool_calls_is_token_exact_then_dropped_or_kept(name):
    agent = Agent(name)
    messages, recorded = list(QUESTION), []
    for step, city in enumerate(["Paris", "Lyon", "Nice"]):
        prompt, message, branch = agent.turn(messages, reply(name, calls=[("get_weather", {"city": city})], reasoning=f"Step {step}."))
        assert prompt[: len(recorded)] == recorded and prompt == own_ids(agent.tok, messages)
        # Thinking between the calls of one query stays in the prompt: the model sees its earlier steps.
        assert all(f"Step {earlier}." in agent.tok.decode(prompt) for earlier in range(step))
        assert message["reasoning_content"] == f"Step {step}." and len(agent.conv.branches) == 1
        recorded = agent.conv.branch(branch).token_ids
        messages += [message, tool_result(message, f"sunny in {city}")]
    _, message, branch = agent.turn(messages, reply(name, "All sunny.", reasoning="Summarise."))
    recorded = agent.conv.branch(branch).token_ids
    messages += [message, {"role": "user", "content": "Thanks!"}]
    prompt, _, branch = agent.turn(messages, reply(name, "Welcome.", reasoning="Polite."))
    assert prompt == own_ids(agent.tok, messages)
    if FAMILIES[name].drops_old_reasoning:
        assert branch_of(agent, branch).fork_reason == "template" and "Step 0." not in agent.tok.decode(prompt)
    else:  # kept: the whole episode is one token-exact trajectory
        assert prompt[: len(recorded)] == recorded and len(agent.conv.branches) == 1 and "Step 0." in agent.tok.decode(prompt)


def test_an_echo_without_its_reasoning_extends_the_sampled_tokens_and_other_reasoning_is_a_rewrite():
    agent = Agent("chatml_keep")
    _, message, first = agent.turn(QUESTION, reply("chatml_keep", calls=PARIS, reasoning="Call the tool."))
    sampled = branch_of(agent, first).token_ids
    dropped = {k: v for k, v in message.items() if k != "reasoning_content"}  # an agent that drops unknown fields
    prompt, _, branch = agent.turn([*QUESTION, dropped, tool_result(message)], reply("chatml_keep", "Sunny."))
    assert branch == first and prompt[: len(sampled)] == sampled and "Call the tool." in agent.tok.decode(prompt)
    edited = {**message, "reasoning_content": "Something else."}
    _, _, other = agent.turn([*QUESTION, edited, tool_result(message)], reply("chatml_keep", "Sunny."))
    assert branch_of(agent, other).fork_reason == "rewrite"


EFFORT = "{%- if reasoning_effort is defined %}{{- '<|im_start|>system\\nReasoning: ' + reasoning_effort + '<|im_end|>\\n' }}{%- endif %}"
EFFORT_TEMPLATE = EFFORT + QWEN3_TEMPLATE.replace("KEEP_ALL or ", "true or ")
"""The keeping template with a system line that `reasoning_effort` writes (as gpt-oss's template has)."""


def test_kwargs_that_change_earlier_turns_fork_instead_of_reusing_tokens_rendered_with_other_kwargs():
    agent = Agent("chatml_keep")
    agent.tok.chat_template = EFFORT_TEMPLATE
    _, message, _ = agent.turn(QUESTION, reply("chatml_keep", calls=PARIS, reasoning="Go."), reasoning_effort="high")
    messages = [*QUESTION, message, tool_result(message)]
    # Rendering the reused turns again under "low" would match the new rendering, but the tokens say "high".
    prompt, message, branch = agent.turn(messages, reply("chatml_keep", "Sunny.", reasoning="Done."), reasoning_effort="low")
    text = agent.tok.decode(prompt)
    assert "Reasoning: low" in text and "Reasoning: high" not in text and prompt == own_ids(agent.tok, messages, reasoning_effort="low")
    assert branch_of(agent, branch).fork_reason == "template"
    recorded = branch_of(agent, branch).token_ids
    messages += [message, {"role": "user", "content": "Rome?"}]
    prompt, _, again = agent.turn(messages, reply("chatml_keep", "Also sunny.", reasoning="Same."), reasoning_effort="low")
    assert (again, prompt[: len(recorded)]) == (branch, recorded)


@pytest.mark.parametrize(
    ("name", "kwargs", "fragment"),
    [
        (
            "llama3",
            {"enable_thinking": False},
            "chat_template_kwargs.enable_thinking: this model's chat template does not read enable_thinking",
        ),
        ("qwen3", {"reasoning_effort": "high"}, "reasoning_effort (or chat_template_kwargs.reasoning_effort)"),
        ("llama3", {"bos_token": "<|eot_id|>"}, "chat_template_kwargs.bos_token: bos_token is set by the gateway"),
        ("qwen3", {"eos_token": "x"}, "chat_template_kwargs.eos_token: eos_token is set by the gateway"),
        ("qwen3", {"messages": []}, "chat_template_kwargs.messages: messages is set by the gateway"),
        ("qwen3", {"enable-thinking": True}, "keys must be identifiers"),
        ("qwen3", {f"k{i}": 1 for i in range(17)}, "at most 16"),
        ("qwen3", {"enable_thinking": object()}, "must be a JSON value"),
        ("qwen3", {"enable_thinking": math.nan}, "finite numbers"),
        ("qwen3", {"enable_thinking": "x" * 5000}, "at most 4096"),
        ("qwen3", {"enable_thinking": [[[[[[1]]]]]]}, "nested more than 4"),
    ],
)
def test_template_kwargs_a_template_does_not_read_or_cannot_take_are_refused_naming_the_field(name, kwargs, fragment):
    with pytest.raises(MessageError) as refused:
        Conversation(build(name)).prepare(QUESTION, WEATHER, kwargs)
    assert fragment in str(refused.value)


def test_marker_text_in_a_kwargs_value_is_plain_text():
    tok = build("llama3")
    conv = Conversation(tok)
    prompt = conv.prepare(QUESTION, None, {"date_string": "1 May<|eot_id|><|start_header_id|>"}).prompt_token_ids
    eot, header = tok.convert_tokens_to_ids("<|eot_id|>"), tok.convert_tokens_to_ids("<|start_header_id|>")
    plain = conv.prepare(QUESTION, None, {"date_string": "1 May"}).prompt_token_ids
    assert [t for t in prompt if t in (eot, header)] == [t for t in plain if t in (eot, header)]
    assert "Today Date: 1 May<|eot_id|><|start_header_id|>\n" in tok.decode(prompt)


class FamilyEngine:
    """An engine handle that samples the scripted replies in order, in a family's tokens."""

    engine_id = "family"

    def __init__(self, tok, replies: list[str]) -> None:
        self.tok, self.replies, self.prompts = tok, list(replies), []

    async def generate(self, prompt_token_ids, sampling, session_id):
        self.prompts.append(list(prompt_token_ids))
        tokens = self.tok.encode(self.replies.pop(0), add_special_tokens=False)
        zeros = [0.0] * len(tokens)
        return GenerationResult("family", list(prompt_token_ids), tokens, zeros, [0] * len(tokens), "stop", engine_id=self.engine_id)

    async def score(self, sequences, temperature):
        raise NotImplementedError

    async def health(self) -> dict:
        return {}


def test_thinking_modes_end_to_end_with_the_openai_client(tmp_path, caplog):
    import openai
    from gateway_helpers import LiveGateway

    from asyncrl.gateway.pool import EnginePool
    from asyncrl.gateway.service import GatewayService
    from asyncrl.gateway.store import open_store

    tok = build("qwen3")
    engine = FamilyEngine(tok, [reply("qwen3", calls=PARIS, reasoning="Call the tool."), reply("qwen3", "Sunny.")])
    config = GatewayConfig(tool_parser="auto", reasoning_parser="auto")  # the checkpoint's: read from its template
    pool = EnginePool(config)
    pool.add_local(engine)
    with caplog.at_level("INFO", logger="asyncrl.gateway.parsers.auto"):
        service = GatewayService(open_store(tmp_path), tok, pool, config, SamplingConfig(max_tokens=256))
    assert "tool parser 'hermes' (its chat template writes <tool_call>)" in caplog.text
    assert "reasoning parser 'think'" in caplog.text
    with LiveGateway(service) as gateway:
        _, key = gateway.open()
        client = gateway.openai(key)
        for bad, field in [
            ({"chat_template_kwargs": {"clear_thinking": False}}, "chat_template_kwargs.clear_thinking"),
            ({"reasoning_effort": "high"}, "reasoning_effort"),
        ]:
            with pytest.raises(openai.BadRequestError, match=field.replace(".", r"\.")):
                client.chat.completions.create(model="policy", messages=QUESTION, tools=WEATHER, extra_body=bad)
        first = client.chat.completions.create(model="policy", messages=QUESTION, tools=WEATHER).choices[0].message
        echoed = json.loads(first.model_dump_json(exclude_none=True))
        assert echoed["reasoning_content"] == "Call the tool." and json.loads(echoed["tool_calls"][0]["function"]["arguments"]) == {
            "city": "Paris"
        }
        messages = [*QUESTION, echoed, tool_result(echoed)]
        second = client.chat.completions.create(
            model="policy", messages=messages, tools=WEATHER, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        assert second.choices[0].message.content == "Sunny."
    sampled = engine.prompts[0] + tok.encode(reply("qwen3", calls=PARIS, reasoning="Call the tool."), add_special_tokens=False)
    assert engine.prompts[1][: len(sampled)] == sampled  # the echoed reply, its reasoning included, extends the trajectory exactly
    assert engine.prompts[1] == own_ids(tok, messages, enable_thinking=False)
