"""`InProcessTransport`: the official OpenAI client calling the gateway's app without a socket records
exactly what the same call over loopback HTTP records, streams as the app sends, answers refusals with
the same statuses, and behaves as a socket when its client gives up: a cancelled stream aborts the
engine request (its turn recorded truncated), a cancelled plain call still completes and is recorded."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from gateway_helpers import TOKENIZER, LiveGateway, Replier, make_engine, make_service, scripted_model

from asyncrl.configs.schema import SamplingConfig
from asyncrl.gateway.inprocess_transport import InProcessHttpClient, InProcessTransport
from asyncrl.gateway.store import open_store
from asyncrl.lifecycle import Rollout
from asyncrl.policy.tokenizer import ASSISTANT, EOS

USER = [{"role": "user", "content": "hi"}]
SCRIPT = [ASSISTANT, *"Hi, bot!", EOS]
WAIT_S = 60.0


@pytest.fixture(scope="module")
def engine():
    engine = make_engine("text", scripted_model(SCRIPT))
    yield engine
    engine.shutdown()


def _on_loop(gateway: LiveGateway, make_coroutine):
    """Run `make_coroutine(client_for)` on the gateway's event loop, where its app and pool live;
    `client_for(key)` is the OpenAI client an episode gets (`EpisodeClient`), reaching the app through
    the episodes' in-process HTTP client."""

    async def main():
        http = InProcessHttpClient(gateway.server.config.app)

        def client_for(key: str) -> openai.AsyncOpenAI:
            return Rollout("", key, gateway.url + "/v1").async_openai(http_client=http, max_retries=0)

        try:
            return await make_coroutine(client_for)
        finally:
            await http.aclose()

    return asyncio.run_coroutine_threadsafe(main(), gateway.loop).result(timeout=WAIT_S)


def _turn(gateway: LiveGateway, rollout_id: str):
    return gateway.service.store.get(rollout_id).turns[0]


def _same_record(a, b) -> None:
    for name in ("prompt_token_ids", "completion_token_ids", "logprobs", "versions", "finish_reason", "temperature", "top_p", "top_k"):
        assert getattr(a, name) == getattr(b, name), name


def test_calls_through_the_transport_are_recorded_as_over_http(engine, tmp_path) -> None:
    service = make_service(open_store(tmp_path), [engine], sampling=SamplingConfig(max_tokens=16), sampling_overrides="allow")
    with LiveGateway(service) as gateway:
        (http_id, http_key), (plain_id, plain_key), (streamed_id, streamed_key) = (gateway.open() for _ in range(3))
        asked = dict(model="policy", messages=USER, seed=7, logprobs=True, temperature=0.7)  # sampling_overrides=allow
        over_http = gateway.openai(http_key).chat.completions.create(**asked)

        async def calls(client_for):
            plain = await client_for(plain_key).chat.completions.create(**asked)
            stream = await client_for(streamed_key).chat.completions.create(**asked, stream=True, stream_options={"include_usage": True})
            return plain, [chunk async for chunk in stream]

        plain, chunks = _on_loop(gateway, calls)
        assert plain.choices[0].message.content == over_http.choices[0].message.content == "Hi, bot!"
        assert plain.usage.completion_tokens == over_http.usage.completion_tokens
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hi, bot!"
        assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
        _same_record(_turn(gateway, http_id), _turn(gateway, plain_id))
        _same_record(_turn(gateway, http_id), _turn(gateway, streamed_id))
        assert _turn(gateway, plain_id).temperature == 0.7


def test_refusals_keep_their_status(engine, tmp_path) -> None:
    with LiveGateway(make_service(open_store(tmp_path), [engine])) as gateway:
        _, key = gateway.open()

        async def refused(client_for):
            statuses = []
            for client, body in ((client_for("not-a-key"), {"messages": USER}), (client_for(key), {"messages": "not a list"})):
                try:
                    await client.chat.completions.create(model="policy", **body)
                except openai.APIStatusError as error:
                    statuses.append((error.status_code, error.message))
            return statuses

        (unauthorized, _), (invalid, message) = _on_loop(gateway, refused)
        assert unauthorized == 401
        assert invalid in (400, 422) and "messages" in message


def test_a_cancelled_stream_aborts_the_engine_request_and_keeps_its_tokens(tmp_path) -> None:
    reply = [*TOKENIZER.encode("Hi, bot!", add_special_tokens=False), TOKENIZER.eos_token_id]
    handle = Replier(reply, hold=3)
    with LiveGateway(make_service(open_store(tmp_path), [handle])) as gateway:
        rollout_id, key = gateway.open()

        async def leave_mid_stream(client_for):
            stream = await client_for(key).chat.completions.create(model="policy", messages=USER, stream=True)
            received = []

            async def read():
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        received.append(chunk.choices[0].delta.content)

            reader = asyncio.create_task(read())
            while len("".join(received)) < 3:  # the engine holds the rest until the request is aborted
                await asyncio.sleep(0.01)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            return "".join(received)

        assert _on_loop(gateway, leave_mid_stream) == "Hi,"
        assert handle.closed.wait(WAIT_S), "the engine request was not aborted"
        deadline = time.monotonic() + WAIT_S
        while not gateway.service.store.get(rollout_id).turns and time.monotonic() < deadline:
            time.sleep(0.02)
        turn = _turn(gateway, rollout_id)
        assert turn.finish_reason == "abort" and turn.completion_token_ids == reply[:3]
        assert gateway.service.health()["requests_in_flight"] == 0


@pytest.mark.parametrize("call", ["typed", "plain post"])
def test_a_cancelled_plain_call_still_completes_and_is_recorded(tmp_path, call) -> None:
    """Over a socket a client that gives up does not stop the gateway's handler; here neither, through the
    SDK's typed call or an `EpisodeClient`'s plain post (which goes to the transport directly)."""
    reply = [*TOKENIZER.encode("Hi, bot!", add_special_tokens=False), TOKENIZER.eos_token_id]
    release = asyncio.Event()

    class Slow(Replier):
        async def generate(self, prompt_token_ids, sampling, session_id):
            await release.wait()
            return await super().generate(prompt_token_ids, sampling, session_id)

    with LiveGateway(make_service(open_store(tmp_path), [Slow(reply)])) as gateway:
        rollout_id, key = gateway.open()

        async def give_up(client_for):
            client = client_for(key)
            if call == "typed":
                request = client.chat.completions.create(model="policy", messages=USER)
            else:
                request = client.post("/chat/completions", cast_to=object, body={"model": "policy", "messages": USER})
            call_task = asyncio.create_task(request)
            while gateway.service.health()["requests_in_flight"] == 0:
                await asyncio.sleep(0.01)
            call_task.cancel()
            await asyncio.gather(call_task, return_exceptions=True)
            recorded_before = len(gateway.service.store.get(rollout_id).turns)
            release.set()
            while gateway.service.health()["requests_in_flight"]:
                await asyncio.sleep(0.01)
            return call_task.cancelled(), recorded_before

        cancelled, recorded_before = _on_loop(gateway, give_up)
        assert cancelled and recorded_before == 0
        turn = _turn(gateway, rollout_id)
        assert turn.completion_token_ids == reply and turn.finish_reason == "stop"


def test_an_app_that_raises_answers_500(tmp_path) -> None:
    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    async def main():
        http = openai.DefaultAsyncHttpxClient(transport=InProcessTransport(broken), timeout=None)
        client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="k", http_client=http, max_retries=0)
        try:
            with pytest.raises(openai.InternalServerError):
                await client.chat.completions.create(model="policy", messages=USER)
        finally:
            await http.aclose()

    asyncio.run(main())
