"""`InProcessTransport`: the official OpenAI client calling the gateway's app without a socket records
exactly what the same call over loopback HTTP records, streams as the app sends, answers refusals with
the same statuses, and behaves as a socket when its client gives up: a cancelled stream aborts the
engine request (its turn recorded truncated), a cancelled plain call still completes and is recorded.

`EpisodeClient`, the client an episode gets: its plain JSON post goes to the transport directly,
without the SDK's request building, and nothing else changes: the same reply, the same recorded turn,
the same exception for a refusal; every other call (typed, streamed, retrying, customized, or over a
socket) is the SDK's."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from gateway_helpers import TOKENIZER, LiveGateway, Replier, make_engine, make_service, scripted_model

from asyncrl.configs.schema import SamplingConfig
from asyncrl.episode_client import EpisodeClient
from asyncrl.gateway.inprocess_transport import InProcessHttpClient, InProcessTransport
from asyncrl.gateway.store import open_store
from asyncrl.lifecycle import Rollout
from asyncrl.policy.tokenizer import ASSISTANT, EOS

USER = [{"role": "user", "content": "hi"}]
SCRIPT = [ASSISTANT, *"Hi, bot!", EOS]
BODY = {"model": "policy", "messages": USER, "max_tokens": 16, "seed": 7}
WAIT_S = 60.0


@pytest.fixture(scope="module")
def engine():
    engine = make_engine("text", scripted_model(SCRIPT))
    yield engine
    engine.shutdown()


@pytest.fixture
def built(monkeypatch):
    """How many requests the SDK built (its `_build_request`), counted for every client."""
    count = [0]
    original = openai.AsyncOpenAI._build_request

    def counting(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(openai.AsyncOpenAI, "_build_request", counting)
    return count


def _on_loop(gateway: LiveGateway, make_coroutine):
    """Run `make_coroutine(client_for)` on the gateway's event loop, where its app and pool live.
    `client_for(key, **options)` is the OpenAI client an episode gets (`EpisodeClient`, no retries unless
    asked), reaching the app through the episodes' in-process HTTP client; with `sdk=True`, a plain
    `openai.AsyncOpenAI` over the same HTTP client."""

    async def main():
        http = InProcessHttpClient(gateway.server.config.app)

        def client_for(key: str, *, sdk: bool = False, **options) -> openai.AsyncOpenAI:
            options = {"max_retries": 0, "http_client": http, **options}
            if sdk:
                return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=key, **options)
            return Rollout("", key, gateway.url + "/v1").async_openai(**options)

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


def test_a_plain_post_goes_to_the_app_directly_and_returns_and_records_what_the_sdk_does(engine, tmp_path, built) -> None:
    with LiveGateway(make_service(open_store(tmp_path), [engine], sampling=SamplingConfig(max_tokens=16))) as gateway:
        (direct_id, direct_key), (sdk_id, sdk_key) = gateway.open(), gateway.open()

        async def both(client_for):
            direct = client_for(direct_key)
            assert isinstance(direct, EpisodeClient)
            reply = await direct.post("/chat/completions", cast_to=object, body=BODY)
            built_by_direct = built[0]
            return reply, built_by_direct, await client_for(sdk_key, sdk=True).post("/chat/completions", cast_to=object, body=BODY)

        direct, built_by_direct, through_sdk = _on_loop(gateway, both)
        assert built_by_direct == 0 and built[0] == 1  # the direct post built no SDK request; the SDK's did
        assert direct["choices"][0]["message"] == through_sdk["choices"][0]["message"]
        assert direct["choices"][0]["message"]["content"] == "Hi, bot!"
        assert direct["usage"] == through_sdk["usage"]
        assert direct["asyncrl"]["rollout_id"] == direct_id
        _same_record(_turn(gateway, direct_id), _turn(gateway, sdk_id))


def test_a_refused_direct_post_raises_what_the_sdk_raises(engine, tmp_path) -> None:
    with LiveGateway(make_service(open_store(tmp_path), [engine])) as gateway:
        _, key = gateway.open()
        finished_id, finished_key = gateway.open()
        gateway.http.post(f"/rollouts/{finished_id}/finish", json={"reward": 0.0}).raise_for_status()
        refused = [("not-a-key", BODY), (key, {**BODY, "messages": "not a list"}), (key, {**BODY, "max_tokens": -1}), (finished_key, BODY)]

        async def errors(client_for):
            seen = []
            for rollout_key, body in refused:
                for client in (client_for(rollout_key), client_for(rollout_key, sdk=True)):
                    try:
                        await client.post("/chat/completions", cast_to=object, body=body)
                    except openai.APIStatusError as error:
                        seen.append((type(error), error.status_code, error.message, error.body))
                    else:
                        seen.append(None)
            return seen

        seen = _on_loop(gateway, errors)
        direct, sdk = seen[0::2], seen[1::2]
        assert direct == sdk
        assert [status for _, status, _, _ in direct] == [401, 400, 400, 409]
        assert direct[0][0] is openai.AuthenticationError and direct[3][0] is openai.ConflictError


def test_typed_streamed_retrying_and_customized_calls_take_the_sdk(engine, tmp_path, built) -> None:
    with LiveGateway(make_service(open_store(tmp_path), [engine])) as gateway:
        keys = [gateway.open()[1] for _ in range(4)]

        async def calls(client_for):
            typed = await client_for(keys[0]).chat.completions.create(model="policy", messages=USER)
            stream = await client_for(keys[1]).chat.completions.create(model="policy", messages=USER, stream=True)
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
            retrying, headed = client_for(keys[2], max_retries=2), client_for(keys[3], default_headers={"x-trace": "1"})
            plain = [await client.post("/chat/completions", cast_to=object, body=BODY) for client in (retrying, headed)]
            return [typed.choices[0].message.content, text, *(reply["choices"][0]["message"]["content"] for reply in plain)]

        assert _on_loop(gateway, calls) == ["Hi, bot!"] * 4
        assert built[0] == 4


def test_over_a_socket_a_plain_post_is_the_sdks(engine, tmp_path, built) -> None:
    with LiveGateway(make_service(open_store(tmp_path), [engine])) as gateway:
        rollout_id, key = gateway.open()

        async def over_http():
            async with Rollout("", key, gateway.url + "/v1").async_openai(max_retries=0) as client:
                return await client.post("/chat/completions", cast_to=object, body=BODY)

        reply = asyncio.run(over_http())
        assert reply["choices"][0]["message"]["content"] == "Hi, bot!" and built[0] == 1
        assert gateway.service.store.get(rollout_id).turns


@pytest.mark.parametrize("base_url", ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/", "http://gateway.local/g1/v1"])
def test_the_base_url_parsed_once_is_the_one_the_sdk_parses(base_url) -> None:
    ours, sdk = EpisodeClient(base_url=base_url, api_key="k"), openai.AsyncOpenAI(base_url=base_url, api_key="k")
    assert ours.base_url == sdk.base_url and str(ours.base_url) == str(sdk.base_url)
    assert ours._prepare_url("/chat/completions") == sdk._prepare_url("/chat/completions")
