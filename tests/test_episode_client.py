"""`EpisodeClient`: an episode's plain JSON post into the gateway's app in this process skips the OpenAI
SDK's request building, and nothing else changes: the same reply, the same recorded turn, the same
exception for a refusal; every other call (typed, streamed, retrying, or over a socket) is the SDK's. A
cancelled direct post behaves as over a socket (tests/test_inprocess_transport.py)."""

from __future__ import annotations

import asyncio

import openai
import pytest
from gateway_helpers import LiveGateway, make_engine, make_service, scripted_model

from asyncrl.configs.schema import SamplingConfig
from asyncrl.episode_client import EpisodeClient
from asyncrl.gateway.inprocess_transport import InProcessHttpClient
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
    """`make_coroutine(http)` on the gateway's loop, `http` the episodes' in-process HTTP client."""

    async def main():
        http = InProcessHttpClient(gateway.server.config.app)
        try:
            return await make_coroutine(http)
        finally:
            await http.aclose()

    return asyncio.run_coroutine_threadsafe(main(), gateway.loop).result(timeout=WAIT_S)


def _rollout(gateway: LiveGateway, key: str) -> Rollout:
    return Rollout("", key, gateway.url + "/v1")


def _record(gateway: LiveGateway, rollout_id: str) -> tuple:
    turn = gateway.service.store.get(rollout_id).turns[0]
    return turn.prompt_token_ids, turn.completion_token_ids, turn.logprobs, turn.finish_reason, turn.temperature


def test_a_plain_post_goes_to_the_app_directly_and_returns_and_records_what_the_sdk_does(engine, tmp_path, built) -> None:
    with LiveGateway(make_service(open_store(tmp_path), [engine], sampling=SamplingConfig(max_tokens=16))) as gateway:
        (direct_id, direct_key), (sdk_id, sdk_key) = gateway.open(), gateway.open()

        async def both(http):
            direct = _rollout(gateway, direct_key).async_openai(max_retries=0, http_client=http)
            assert isinstance(direct, EpisodeClient)
            reply = await direct.post("/chat/completions", cast_to=object, body=BODY)
            built_by_direct = built[0]
            sdk = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=sdk_key, max_retries=0, http_client=http)
            return reply, built_by_direct, await sdk.post("/chat/completions", cast_to=object, body=BODY)

        direct, built_by_direct, through_sdk = _on_loop(gateway, both)
        assert built_by_direct == 0 and built[0] == 1  # the direct post built no SDK request; the SDK's did
        assert direct["choices"][0]["message"] == through_sdk["choices"][0]["message"]
        assert direct["choices"][0]["message"]["content"] == "Hi, bot!"
        assert direct["usage"] == through_sdk["usage"]
        assert direct["asyncrl"]["rollout_id"] == direct_id
        assert _record(gateway, direct_id) == _record(gateway, sdk_id)


def test_a_refused_direct_post_raises_what_the_sdk_raises(engine, tmp_path) -> None:
    with LiveGateway(make_service(open_store(tmp_path), [engine])) as gateway:
        _, key = gateway.open()
        finished_id, finished_key = gateway.open()
        gateway.http.post(f"/rollouts/{finished_id}/finish", json={"reward": 0.0}).raise_for_status()
        refused = [("not-a-key", BODY), (key, {**BODY, "messages": "not a list"}), (key, {**BODY, "max_tokens": -1}), (finished_key, BODY)]

        async def errors(http):
            seen = []
            for rollout_key, body in refused:
                for client in (
                    _rollout(gateway, rollout_key).async_openai(max_retries=0, http_client=http),
                    openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=rollout_key, max_retries=0, http_client=http),
                ):
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

        async def calls(http):
            typed_client, streaming, retrying, headed = (
                _rollout(gateway, key).async_openai(http_client=http, **options)
                for key, options in zip(
                    keys,
                    ({"max_retries": 0}, {"max_retries": 0}, {"max_retries": 2}, {"max_retries": 0, "default_headers": {"x-trace": "1"}}),
                    strict=True,
                )
            )
            typed = await typed_client.chat.completions.create(model="policy", messages=USER)
            stream = await streaming.chat.completions.create(model="policy", messages=USER, stream=True)
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
            plain = [await client.post("/chat/completions", cast_to=object, body=BODY) for client in (retrying, headed)]
            return [typed.choices[0].message.content, text, *(reply["choices"][0]["message"]["content"] for reply in plain)]

        assert _on_loop(gateway, calls) == ["Hi, bot!"] * 4
        assert built[0] == 4


def test_over_a_socket_a_plain_post_is_the_sdks(engine, tmp_path, built) -> None:
    with LiveGateway(make_service(open_store(tmp_path), [engine])) as gateway:
        rollout_id, key = gateway.open()

        async def over_http():
            async with _rollout(gateway, key).async_openai(max_retries=0) as client:
                return await client.post("/chat/completions", cast_to=object, body=BODY)

        reply = asyncio.run(over_http())
        assert reply["choices"][0]["message"]["content"] == "Hi, bot!" and built[0] == 1
        assert gateway.service.store.get(rollout_id).turns


@pytest.mark.parametrize("base_url", ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/", "http://gateway.local/g1/v1"])
def test_the_base_url_parsed_once_is_the_one_the_sdk_parses(base_url) -> None:
    ours, sdk = EpisodeClient(base_url=base_url, api_key="k"), openai.AsyncOpenAI(base_url=base_url, api_key="k")
    assert ours.base_url == sdk.base_url and str(ours.base_url) == str(sdk.base_url)
    assert ours._prepare_url("/chat/completions") == sdk._prepare_url("/chat/completions")
