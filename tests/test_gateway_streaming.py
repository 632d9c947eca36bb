"""`stream: true` end to end with the official `openai` client: the streamed reply is what the plain call
returns, its turn is recorded exactly as the plain call's, characters split across tokens arrive whole,
reasoning and tool calls come in OpenAI's delta shapes, and a client that disconnects mid-stream aborts the
engine request and leaves its turn recorded truncated (finish reason "abort", its sampled tokens kept)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from gateway_helpers import TOKENIZER, TOOLS, LiveGateway, Replier, make_engine, make_service, one_token_per_delta, scripted_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from asyncrl.configs.schema import GatewayConfig, SamplingConfig
from asyncrl.gateway.parsers import parse_reply, reasoning_parser
from asyncrl.gateway.parsers import tool_call_parser as parser_by_name
from asyncrl.gateway.pool import EnginePool
from asyncrl.gateway.replystream import IncrementalDecoder, ReplyStream
from asyncrl.gateway.service import GatewayService
from asyncrl.gateway.store import open_store
from asyncrl.policy.tokenizer import ASSISTANT, EOS
from asyncrl.samples import trajectory_to_samples

USER = [{"role": "user", "content": "hi"}]
TEXT_SCRIPT = [ASSISTANT, *"Hi, bot!", EOS]
WAIT_S = 60.0
"""Longest wait for the gateway to reach a state (a safety valve: waits end on the state)."""


@pytest.fixture(scope="module")
def engines():
    tools, text = make_engine("tools"), make_engine("text", scripted_model(TEXT_SCRIPT))
    yield {"tools": tools, "text": text}
    tools.shutdown()
    text.shutdown()


def _live(tmp_path, handles, **gateway) -> LiveGateway:
    return LiveGateway(make_service(open_store(tmp_path), handles, sampling=SamplingConfig(max_tokens=16), **gateway))


def _turn(gateway, rollout_id: str, index: int = 0):
    return gateway.service.store.get(rollout_id).turns[index]


def _same_record(a, b) -> None:
    for name in ("prompt_token_ids", "completion_token_ids", "logprobs", "versions", "finish_reason", "temperature", "top_p", "top_k"):
        assert getattr(a, name) == getattr(b, name), name


@pytest.mark.parametrize("policy", ["text", "tools"])
def test_a_streamed_chat_returns_and_records_what_the_plain_call_does(engines, tmp_path, policy) -> None:
    with _live(tmp_path, [engines[policy]]) as gateway:
        plain_id, plain_key = gateway.open()
        streamed_id, streamed_key = gateway.open()
        asked = dict(model="policy", messages=USER, tools=TOOLS if policy == "tools" else None, seed=7, logprobs=True)
        asked = {k: v for k, v in asked.items() if v is not None}
        plain = gateway.openai(plain_key).chat.completions.create(**asked)
        streamed = dict(asked, stream=True, stream_options={"include_usage": True})
        with one_token_per_delta(engines[policy]):
            chunks = list(gateway.openai(streamed_key).chat.completions.create(**streamed))
        _same_record(_turn(gateway, plain_id), _turn(gateway, streamed_id))

        assert chunks[0].choices[0].delta.role == "assistant"
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content == (plain.choices[0].message.content or "")
        calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or ()]
        expected = plain.choices[0].message.tool_calls or []
        assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            (i, c.function.name, json.loads(c.function.arguments)) for i, c in enumerate(expected)
        ]
        assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
        finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert [c.choices[0].finish_reason for c in finish] == [plain.choices[0].finish_reason]
        assert finish[0].model_extra["asyncrl"] == {"rollout_id": streamed_id, "turn_index": 0, "branch": 0, "engine_id": policy}
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(exclude_none=True) == plain.usage.model_dump(exclude_none=True)
        logprobs = [(t.token, t.logprob) for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        assert logprobs == [(t.token, t.logprob) for t in plain.choices[0].logprobs.content]
        if policy == "text":
            assert content == "Hi, bot!" and len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1


def test_a_streamed_turn_extends_the_conversation_as_a_plain_one(engines, tmp_path) -> None:
    """The agent sends back the message it assembled from the deltas; the next turn extends the recorded tokens."""
    with _live(tmp_path, [engines["tools"]]) as gateway:
        rollout_id, key = gateway.open()
        client = gateway.openai(key)
        messages: list[dict] = [{"role": "user", "content": "go"}]
        for _ in range(2):
            calls: dict[int, dict] = {}
            for chunk in client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True):
                for call in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
                    calls[call.index] = {"id": call.id, "type": "function", "function": call.function.model_dump()}
            messages += [{"role": "assistant", "content": None, "tool_calls": list(calls.values())}]
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in calls.values()]
        gateway.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": 1.0}).raise_for_status()
        trajectory = gateway.service.store.get(rollout_id)
        assert [t.branch for t in trajectory.turns] == [0, 0]
        assert len(trajectory_to_samples(trajectory)) == 1


def test_a_streamed_text_completion_returns_and_records_what_the_plain_call_does(engines, tmp_path) -> None:
    with _live(tmp_path, [engines["text"]]) as gateway:
        plain_id, plain_key = gateway.open()
        streamed_id, streamed_key = gateway.open()
        prompt = [*TOKENIZER.encode("hello", add_special_tokens=False), TOKENIZER.convert_tokens_to_ids(ASSISTANT)]  # the marker as a token
        plain = gateway.openai(plain_key).completions.create(model="policy", prompt=prompt, seed=3)
        chunks = list(gateway.openai(streamed_key).completions.create(model="policy", prompt=prompt, seed=3, stream=True))
        _same_record(_turn(gateway, plain_id), _turn(gateway, streamed_id))
        assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text == "Hi, bot!"
        assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason == "stop"


def test_the_wire_is_server_sent_events_ending_in_done(engines, tmp_path) -> None:
    with _live(tmp_path, [engines["text"]]) as gateway:
        _, key = gateway.open()
        body = {"messages": USER, "stream": True}
        with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            events = [line for line in response.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        assert all(line.startswith("data: {") for line in events[:-1])
        objects = {json.loads(line[6:])["object"] for line in events[:-1]}
        assert objects == {"chat.completion.chunk"}


def test_a_stream_refused_at_the_start_is_an_http_error(engines, tmp_path) -> None:
    """Before anything was sampled a refusal keeps its status, as without stream (here: a prompt past the cap)."""
    with _live(tmp_path, [engines["text"]], max_prompt_tokens=8) as gateway:
        _, key = gateway.open()
        body = {"messages": [{"role": "user", "content": "x" * 40}], "stream": True}
        response = gateway.http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 400 and "gateway.max_prompt_tokens" in response.json()["error"]["message"]
        assert gateway.service.health()["requests_in_flight"] == 0


# --- byte-level BPE: characters split across tokens, reasoning, Hermes tool calls -----------------------------------

CORPUS = ["Let me think about the weather in Paris.", '{"name": "f", "arguments": {"a": "7"}}', "Checking the sky. Paris is sunny."]
REASONED = "<think>Let me think about Paris.</think>\n\nCa va? \U0001f600 \u4e16\u754c Paris is sunny."
HERMES = 'Checking the sky.\n<tool_call>\n{"name": "f", "arguments": {"a": "7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def bpe() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|im_end|>", "<|im_start|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=alphabet, show_progress=False)
    core.train_from_iterator(CORPUS * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>")
    tokenizer.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


def test_incremental_decoding_releases_whole_characters_only(bpe) -> None:
    text = "Ca va? \U0001f600 \u4e16\u754c \u00e9t\u00e9 <think>x</think>"
    ids = bpe.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) // 2  # the emoji and CJK characters are several byte tokens each
    for step in (1, 2, 3):
        decoder, pieces = IncrementalDecoder(bpe), []
        for at in range(0, len(ids), step):
            pieces.append(decoder.feed(ids[at : at + step]))
        pieces.append(decoder.flush())
        assert "".join(pieces) == bpe.decode(ids, skip_special_tokens=False) == text
        assert not any("\ufffd" in piece for piece in pieces)


REPLIES = [
    ("hermes", "think", REASONED),
    ("hermes", "think", HERMES),
    ("hermes", "think", "<think>Let me think</think>\n\n" + HERMES),
    ("hermes", None, "Paris is sunny.\n\n  "),
    ("hermes", None, 'Checking <tool_call>{"name": "f"} and more'),  # a malformed call: all of it is content
    ("llama3_json", None, '{"name": "f", "parameters": {"a": "7"}}'),
    ("llama3_json", None, "Paris is {sunny}."),
    ("glm45", "think", "<think>\nLet me think about the weather.\n</think>\nCa va? \U0001f600"),
]


@pytest.mark.parametrize(("tool_parser", "reasoning", "reply"), REPLIES)
def test_the_live_split_sends_what_the_final_parse_returns(bpe, tool_parser, reasoning, reply) -> None:
    """Fed a token at a time, the deltas add up to the parsed reply's reasoning and content, and what is sent
    before the end is never taken back."""
    parsers = (parser_by_name(tool_parser), reasoning_parser(reasoning) if reasoning else None)
    ids = [*bpe.encode(reply, add_special_tokens=False), bpe.eos_token_id]
    parsed = parse_reply(ids, bpe, TOOLS, lambda: "call_0", *parsers)
    stream = ReplyStream(bpe, *parsers, bpe.encode("<|im_start|>assistant\n"))
    live = [delta for token in ids for delta in stream.feed([token])]
    sent = {"reasoning": "", "content": ""}
    for name, text in [*live, *stream.finish(parsed)]:
        sent[name] += text
    assert sent == {"reasoning": parsed.reasoning_content or "", "content": parsed.content}
    assert all(text for _, text in live)


def test_a_template_that_opens_thinking_streams_reasoning_from_the_first_token(bpe) -> None:
    ids = [*bpe.encode("Let me think.</think>\n\nParis.", add_special_tokens=False), bpe.eos_token_id]
    stream = ReplyStream(bpe, parser_by_name("hermes"), reasoning_parser("think"), bpe.encode("<|im_start|>assistant\n<think>\n"))
    live = [delta for token in ids for delta in stream.feed([token])]
    assert live[0][0] == "reasoning" and "".join(t for n, t in live if n == "reasoning") == "Let me think."
    assert "".join(t for n, t in live if n == "content") == "Paris."


def _bpe_gateway(tmp_path, tokenizer, reply: str, **gateway) -> tuple[LiveGateway, Replier]:
    handle = Replier([*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id])
    config = GatewayConfig(**gateway)
    pool = EnginePool(config)
    pool.add_local(handle)
    return LiveGateway(GatewayService(open_store(tmp_path), tokenizer, pool, config, SamplingConfig(max_tokens=64))), handle


def test_reasoning_and_split_characters_stream_as_the_plain_reply_reads(bpe, tmp_path) -> None:
    live, _ = _bpe_gateway(tmp_path, bpe, REASONED, reasoning_parser="think")
    with live as gateway:
        plain_id, plain_key = gateway.open()
        streamed_id, streamed_key = gateway.open()
        plain = gateway.openai(plain_key).chat.completions.create(model="policy", messages=USER).choices[0].message
        chunks = list(gateway.openai(streamed_key).chat.completions.create(model="policy", messages=USER, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra.get("reasoning_content")]
        content = [d.content for d in deltas if d.content]
        assert plain.model_extra["reasoning_content"] == "".join(reasoning) == "Let me think about Paris."
        assert plain.content == "".join(content) == "Ca va? \U0001f600 \u4e16\u754c Paris is sunny."
        assert len(reasoning) > 1 and len(content) > 1  # sent as sampled, not at the end
        assert not any("\ufffd" in piece for piece in reasoning + content)
        _same_record(_turn(gateway, plain_id), _turn(gateway, streamed_id))


def test_hermes_tool_calls_stream_after_their_content(bpe, tmp_path) -> None:
    live, _ = _bpe_gateway(tmp_path, bpe, HERMES, tool_parser="hermes")
    with live as gateway:
        _, key = gateway.open()
        chunks = list(gateway.openai(key).chat.completions.create(model="policy", messages=USER, tools=TOOLS, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == "Checking the sky."
        calls = [call for d in deltas for call in d.tool_calls or ()]
        assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [(0, "f", {"a": "7"})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"the gateway never reached: {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_client_that_disconnects_mid_stream_aborts_the_request_and_keeps_its_tokens(bpe, tmp_path, path) -> None:
    live, handle = _bpe_gateway(tmp_path, bpe, "Checking the sky. Paris is sunny.")
    handle.hold = 4
    with live as gateway:
        rollout_id, key = gateway.open()
        body = {"messages": USER, "stream": True} if path.endswith("chat/completions") else {"prompt": "hi", "stream": True}
        with httpx.stream("POST", gateway.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=WAIT_S) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if any(f'"{field}":"' in line and f'"{field}":""' not in line for field in ("content", "text")):
                    break  # the first tokens arrived; the client leaves while the engine holds the rest
        assert handle.closed.wait(WAIT_S), "the engine request was not aborted"
        _wait_until(lambda: len(gateway.service.store.get(rollout_id).turns) == 1, "the truncated turn recorded")
        turn = _turn(gateway, rollout_id)
        assert turn.finish_reason == "abort" and turn.engine_id == handle.engine_id
        assert turn.completion_token_ids == handle.reply_ids[:4]
        assert turn.logprobs == [-0.125, -0.25, -0.375, -0.5] and turn.versions == [3] * 4
        assert gateway.service.health()["requests_in_flight"] == 0
        info = gateway.http.get(f"/rollouts/{rollout_id}").json()
        assert info["in_flight"] == 0 and info["status"] == "running"
        handle.hold = None
        again = gateway.openai(key).chat.completions.create(model="policy", messages=USER)
        assert again.choices[0].message.content == "Checking the sky. Paris is sunny."
        gateway.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": 1.0}).raise_for_status()
        samples = trajectory_to_samples(gateway.service.store.get(rollout_id))
        assert sum(sum(s.loss_mask) for s in samples) == 4 + len(handle.reply_ids)  # the aborted turn's tokens train too


def test_an_engine_that_fails_mid_stream_ends_it_with_an_error_event(bpe, tmp_path) -> None:
    """The client gets the error in the stream (the openai client raises it); nothing is recorded, and the
    rollout takes its next call."""
    live, handle = _bpe_gateway(tmp_path, bpe, "Checking the sky. Paris is sunny.")
    handle.fail = 3
    with live as gateway:
        rollout_id, key = gateway.open()
        client = gateway.openai(key)
        received = []
        with pytest.raises(openai.APIError, match="failed after streaming 3 tokens"):
            for chunk in client.chat.completions.create(model="policy", messages=USER, stream=True):
                received.append(chunk)
        assert received and received[0].choices[0].delta.role == "assistant"
        assert gateway.service.store.get(rollout_id).turns == []
        handle.fail = None
        again = client.chat.completions.create(model="policy", messages=USER)
        assert again.choices[0].message.content == "Checking the sky. Paris is sunny."


TEXTS = ["", "plain", 'quote " and \\ back', "line\nbreak\ttab", "\u00e9t\u00e9 \U0001f600 \u4e16", "\x00slot\x00", "\u2028"]


@pytest.mark.parametrize("text", TEXTS)
def test_a_text_delta_chunk_is_byte_for_byte_the_generic_chunk(text) -> None:
    from asyncrl.gateway.streaming import ChatChunks

    chunks = ChatChunks("policy", "r" * 32)
    for field in ("content", "reasoning_content"):
        assert chunks.text(field, text) == chunks.chunk({field: text})


def test_the_marker_search_and_the_partial_tag_cut_agree_with_the_plain_scans() -> None:
    """`_Search` (first characters first, each part of the text scanned once) and `_partial_cut` (a prefix set)
    against the plain scans they replace, on random texts full of markup pieces."""
    import random

    from asyncrl.gateway.replystream import _partial_cut, _Search
    from asyncrl.gateway.toolcalls import MARKERS

    def plain_cut(text: str, start: int, end: int, tags) -> int:
        sizes = [s for tag in tags for s in range(1, min(len(tag) - 1, end - start) + 1) if text.endswith(tag[:s], start, end)]
        return end - max(sizes, default=0)

    rng = random.Random(0)
    for needles in (MARKERS, ("</think>",), ("<tool_call>", "</tool_call>"), ("", "x")):
        alphabet = "".join(sorted(set("".join(needles)))) + "ab \n"
        for _ in range(500):
            search, text, start = _Search(), "", 0
            for _ in range(rng.randint(1, 10)):
                text += "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
                if rng.random() < 0.3:
                    needle = rng.choice(needles)
                    text += needle[: rng.randint(0, len(needle))] if rng.random() < 0.5 else needle
                start = rng.randint(0, len(text)) if rng.random() < 0.2 else start
                found = [at for at in (text.find(n, start) for n in needles) if at >= 0]
                assert search.find(text, needles, start) == min(found, default=-1), (text, start, needles)
                end = rng.randint(start, len(text))
                assert _partial_cut(text, start, end, needles) == plain_cut(text, start, end, needles), (text, start, end, needles)


def test_stopping_the_gateway_waits_for_the_recordings_still_running(tmp_path) -> None:
    """A turn still being recorded when the gateway stops (a stream whose client left just before) is
    recorded before the server's loop ends; without the wait, the loop's end would cancel it."""
    import asyncio

    engine = make_engine("drain")
    recorded: list[str] = []
    gateway = LiveGateway(make_service(open_store(tmp_path / "store"), [engine]))
    background = gateway.service.background
    drain, draining = background.drain, asyncio.Event()

    async def drain_noted(timeout_s: float) -> None:
        draining.set()
        await drain(timeout_s)

    background.drain = drain_noted
    with gateway:

        async def recording() -> None:
            # Still recording when the shutdown is under way, however long it takes to get there: only
            # the wait for it lets this end; a shutdown that does not wait cancels it first.
            await draining.wait()
            recorded.append("turn")

        gateway.on_loop(background.start, recording())
    engine.shutdown()
    assert recorded == ["turn"]
