"""Per-rollout limits and bounded work under concurrent and oversized requests, through a real gateway
(uvicorn on loopback) in front of a real engine: the branch, turn and token limits hold for calls on one key at once,
a message over `max_message_chars` is refused before anything renders it, and a big prompt is rendered
and tokenized off the event loop while other rollouts' requests go on."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from gateway_helpers import LiveGateway, ManualClock, Pausable, make_engine, make_service

from asyncrl.gateway.engines import LocalEngine
from asyncrl.gateway.store import open_store
from asyncrl.gateway.turns import OFFLOAD_CHARS

MAX_BRANCHES = 8
CALLS = 200
USER = [{"role": "user", "content": "go"}]


@pytest.fixture(scope="module")
def engine():
    engine = make_engine("e0")
    yield engine
    engine.shutdown()


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _burst(live: LiveGateway, paused: Pausable, key: str, body: dict) -> list[httpx.Response]:
    """CALLS requests with `body` on one key at once, none of them committed until every one has been
    either refused or sent to the engine."""
    paused.pause()
    before = paused.calls

    async def calls() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=live.url, headers=_bearer(key), timeout=120, limits=limits) as client:
            tasks = [asyncio.create_task(client.post("/v1/chat/completions", json=body)) for _ in range(CALLS)]
            deadline = time.monotonic() + 120  # a hang guard, not part of the verdict
            while paused.calls - before + sum(t.done() for t in tasks) < CALLS:
                assert time.monotonic() < deadline, "calls neither refused nor sent to the engine"
                await asyncio.sleep(0.01)
            paused.resume()
            return await asyncio.gather(*tasks)

    return asyncio.run(calls())


@pytest.mark.parametrize("history", ["fresh", "extending"])
def test_concurrent_calls_on_one_key_stay_within_max_branches(engine, tmp_path, history) -> None:
    paused = Pausable(engine)
    with LiveGateway(make_service(open_store(tmp_path), [paused], max_branches=MAX_BRANCHES)) as live:
        rollout_id, key = live.open()
        messages = USER
        if history == "extending":  # one turn first: every call extends its branch, all but one fork at commit
            first = live.http.post("/v1/chat/completions", json={"messages": USER}, headers=_bearer(key)).json()
            messages = [*USER, first["choices"][0]["message"], {"role": "user", "content": "again"}]
        responses = _burst(live, paused, key, {"messages": messages})
        answered = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code != 200]
        assert answered, "no call got through"
        for response in refused:
            assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_branches", response.text
            assert "max_branches" in response.json()["error"]["message"]
        conversation = live.service.rollouts.live[rollout_id].conversation
        assert len(conversation.branches) <= MAX_BRANCHES
        turns = live.service.store.get(rollout_id).turns
        assert len(turns) == len(answered) + (history == "extending")  # a refused turn is not recorded
        assert len({t.branch for t in turns}) == len(conversation.branches) <= MAX_BRANCHES


MAX_TURNS, MAX_TOKENS, TOKENS_PER_CALL = 8, 40, 4


@pytest.mark.parametrize("limit", ["max_rollout_turns", "max_rollout_tokens"])
def test_concurrent_calls_on_one_key_stay_within_the_rollout_turn_and_token_limits(engine, tmp_path, limit) -> None:
    limits = {"max_rollout_turns": MAX_TURNS} if limit == "max_rollout_turns" else {"max_rollout_tokens": MAX_TOKENS}
    paused = Pausable(engine)
    # Branches are not the limit here: every call on USER starts one.
    with LiveGateway(make_service(open_store(tmp_path), [paused], max_branches=1000, **limits)) as live:
        rollout_id, key = live.open()
        responses = _burst(live, paused, key, {"messages": USER, "max_tokens": TOKENS_PER_CALL})
        answered = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code != 200]
        assert answered and refused, [r.status_code for r in responses]
        code = "too_many_turns" if limit == "max_rollout_turns" else "too_many_tokens"
        for response in refused:
            assert response.status_code == 400 and response.json()["error"]["code"] == code, response.text
            assert f"gateway.{limit} is {limits[limit]}" in response.json()["error"]["message"]
        turns = live.service.store.get(rollout_id).turns
        assert len(turns) == len(answered)  # a refused call records nothing
        if limit == "max_rollout_turns":
            assert len(turns) <= MAX_TURNS
        else:
            assert sum(len(t.completion_token_ids) for t in turns) <= MAX_TOKENS
        # Spent, not only held: a call after the burst is refused as well.
        after = live.http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": TOKENS_PER_CALL}, headers=_bearer(key))
        if limit == "max_rollout_turns" or sum(len(t.completion_token_ids) for t in turns) + TOKENS_PER_CALL > MAX_TOKENS:
            assert after.status_code == 400 and after.json()["error"]["code"] == code, after.text


def test_a_rollout_picked_up_from_the_store_keeps_the_turns_it_spent(engine, tmp_path) -> None:
    with LiveGateway(make_service(open_store(tmp_path), [engine], max_rollout_turns=2)) as live:
        rollout_id, key = live.open()
        for _ in range(2):
            assert live.http.post("/v1/chat/completions", json={"messages": USER}, headers=_bearer(key)).status_code == 200
        live.on_loop(live.service.rollouts.live.pop, rollout_id)  # as after a restart: only the store knows the rollout
        again = live.http.post("/v1/chat/completions", json={"messages": USER}, headers=_bearer(key))
        assert again.status_code == 400 and "gateway.max_rollout_turns is 2" in again.json()["error"]["message"], again.text
        assert rollout_id in live.service.rollouts.live  # it was picked up, and refused for what the store holds


class Spy:
    """The gateway's template, with every render and encode it is asked for noted."""

    def __init__(self, template) -> None:
        self._template, self.calls = template, []

    def __getattr__(self, name):
        method = getattr(self._template, name)
        if name not in ("render", "encode", "encode_text"):
            return method

        def noted(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)

        return noted


def test_a_5_mb_message_is_refused_before_anything_renders_it(engine, tmp_path) -> None:
    service = make_service(open_store(tmp_path), [engine])
    service.template = spy = Spy(service.template)
    huge = "x" * 5_000_000
    with LiveGateway(service) as live:
        _, key = live.open()
        requests = [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages[0]"),
            ("/v1/chat/completions", {"messages": [*USER, {"role": "tool", "content": [{"type": "text", "text": huge}]}]}, "messages[1]"),
            ("/v1/completions", {"prompt": huge}, "prompt"),
        ]
        for path, body, where in requests:
            response = live.http.post(path, json=body, headers=_bearer(key))
            assert response.status_code == 400, response.text
            message = response.json()["error"]["message"]
            assert "max_message_chars" in message and where in message and "5000000" in message
        assert spy.calls == []  # refused before any rendering or tokenizing
        assert live.http.post("/v1/chat/completions", json={"messages": USER}, headers=_bearer(key)).status_code == 200
        assert spy.calls  # the template is the one the gateway uses


class Held:
    """The gateway's template, holding any encode of a big text until the test lets it go."""

    def __init__(self, template) -> None:
        self._template = template
        self.entered, self.release = threading.Event(), threading.Event()
        self.released_by_test: list[bool] = []

    def __getattr__(self, name):
        return getattr(self._template, name)

    def _hold(self, text: str) -> None:
        if len(text) > OFFLOAD_CHARS:
            self.entered.set()
            # False: it waited this long without the test letting it go (the loop was blocked).
            self.released_by_test.append(self.release.wait(30))

    def encode(self, text: str) -> list[int]:
        self._hold(text)
        return self._template.encode(text)

    def encode_text(self, text: str) -> list[int]:
        self._hold(text)
        return self._template.encode_text(text)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_big_prompt_is_tokenized_off_the_event_loop(engine, tmp_path, path) -> None:
    service = make_service(open_store(tmp_path), [engine], max_prompt_tokens=1000)
    service.template = held = Held(service.template)
    text = "y" * (2 * OFFLOAD_CHARS)
    big_body = {"messages": [{"role": "user", "content": text}]} if path.endswith("chat/completions") else {"prompt": text}
    with LiveGateway(service) as live:
        _, big_key = live.open()
        _, small_key = live.open()

        async def both() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
                big = asyncio.create_task(client.post(path, json=big_body, headers=_bearer(big_key)))
                assert await asyncio.to_thread(held.entered.wait, 60), "the big prompt was never tokenized"
                small = await client.post("/v1/chat/completions", json={"messages": USER}, headers=_bearer(small_key))
                held.release.set()  # only now may the big prompt's tokenizing finish
                return small, await big

        small, big = asyncio.run(both())
        assert small.status_code == 200, small.text
        assert held.released_by_test == [True]  # the small one was answered while the big one was still being tokenized
        # The big prompt was tokenized in full, then refused for its length (the engine's context is short).
        assert big.status_code == 400 and "max_prompt_tokens" in big.json()["error"]["message"], big.text


class Tokenizing:
    """The gateway's template, noting while an encode of a big text is running (it still encodes it). Such
    an encode returns only once `enough()` holds, so what the test wants to happen while prompts are
    tokenized happens at any speed of the machine; a minute without it (the loop is blocked) lets it go."""

    def __init__(self, template, enough) -> None:
        self._template, self.enough, self.running, self.finished = template, enough, 0, 0
        self._counting = threading.Lock()  # two prompts are tokenized at once, on two threads

    def __getattr__(self, name):
        return getattr(self._template, name)

    def _tokenize(self, encode, text: str) -> list[int]:
        if len(text) <= OFFLOAD_CHARS:
            return encode(text)
        with self._counting:
            self.running += 1
        try:
            ids = encode(text)
            deadline = time.monotonic() + 60  # a hang guard: the verdict reads the heartbeats, not this
            while not self.enough() and time.monotonic() < deadline:
                time.sleep(0.005)
            return ids
        finally:
            with self._counting:
                self.running -= 1
                self.finished += 1

    def encode(self, text: str) -> list[int]:
        return self._tokenize(self._template.encode, text)

    def encode_text(self, text: str) -> list[int]:
        return self._tokenize(self._template.encode_text, text)


class Watched(LocalEngine):
    """A real engine that counts the gateway's heartbeats (its health checks) made while `busy()`."""

    def __init__(self, engine, busy) -> None:
        super().__init__(engine)
        self.busy, self.heartbeats_while_busy = busy, 0

    async def health(self) -> dict:
        self.heartbeats_while_busy += bool(self.busy())
        return await super().health()


def test_an_engine_keeps_its_heartbeats_while_big_prompts_are_tokenized(engine, tmp_path) -> None:
    # Heartbeats asked for every 50 ms; the prompts' tokenizing lasts until three came, which a loop blocked
    # by it would never ask for. The registry's clock stands still, so no heartbeat a busy machine delayed
    # can drop the engine: any deregistration below is the gateway's doing.
    config = dict(heartbeat_interval_s=0.05, heartbeat_timeout_s=2.0, max_prompt_tokens=1000)
    service = make_service(open_store(tmp_path), [], clock=ManualClock(), **config)
    watched = Watched(engine, busy=lambda: tokenizing.running > 0)
    service.template = tokenizing = Tokenizing(service.template, enough=lambda: watched.heartbeats_while_busy >= 3)
    service.pool.add_local(watched)
    dropped: list[str] = []
    service.pool.registry.subscribe(lambda event: event.kind == "deregistered" and dropped.append(event.reason))
    content = "ab c" * (service.config.max_message_chars // 4)  # every message at max_message_chars
    big = {"messages": [{"role": "user", "content": content}] * 2}
    with LiveGateway(service) as live:
        keys = [live.open()[1] for _ in range(2)]

        async def all_big() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=live.url, timeout=600) as client:
                return await asyncio.gather(*(client.post("/v1/chat/completions", json=big, headers=_bearer(key)) for key in keys))

        responses = asyncio.run(all_big())
        for response in responses:  # tokenized in full, then refused for their length
            assert response.status_code == 400 and "max_prompt_tokens" in response.json()["error"]["message"], response.text
        assert tokenizing.finished >= len(keys)
        assert watched.heartbeats_while_busy >= 3  # the heartbeat loop ran while the prompts were tokenized
        assert dropped == []  # and the engine was never dropped for a missed one
        assert [info.id for info in live.on_loop(service.pool.registry.alive)] == [engine.engine_id]
        assert live.http.post("/v1/chat/completions", json={"messages": USER}, headers=_bearer(keys[0])).status_code == 200
