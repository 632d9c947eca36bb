"""2,000 sessions at once through a live gateway: each opens a rollout, takes one or two chat turns and
finishes it, with no error, and every one of them is in the store as it happened.

The engines are stubs that answer a tool call at once, except that the first turn of every session is
held at the engine until all 2,000 first turns have arrived: so the gateway provably holds 2,000
requests in flight together (an event, not a timing), then every session goes on at once."""

from __future__ import annotations

import asyncio

import pytest
from gateway_helpers import LiveGateway, make_service

from asyncrl.bench.gateway import TOOLS, _completion_ids
from asyncrl.configs.schema import SamplingConfig
from asyncrl.gateway.store import open_store
from asyncrl.records import GenerationResult

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SESSIONS = 2000
GATE_TIMEOUT_S = 300.0
"""A safety valve only: should fewer first turns ever arrive, the held ones are released after this and the
test fails on `gate.all_arrived`, instead of hanging until pytest's timeout."""


class Gate:
    """Holds the first `expected` calls until all of them are waiting."""

    def __init__(self, expected: int) -> None:
        self.expected, self.arrived, self.all_arrived = expected, 0, False
        self.open = asyncio.Event()

    async def hold(self) -> None:
        self.arrived += 1
        if self.arrived > self.expected:
            return
        if self.arrived == self.expected:
            self.all_arrived = True
            self.open.set()
        try:
            await asyncio.wait_for(self.open.wait(), GATE_TIMEOUT_S)
        except TimeoutError:
            self.open.set()


class GatedStubEngine:
    """An engine handle that answers a python tool call, after `gate` lets the call through."""

    def __init__(self, engine_id: str, gate: Gate) -> None:
        self.engine_id, self.gate, self.completion = engine_id, gate, _completion_ids()

    async def generate(self, prompt_token_ids, sampling, session_id):
        await self.gate.hold()
        n = min(len(self.completion), sampling.max_tokens)
        tokens = self.completion[:n]
        return GenerationResult("", list(prompt_token_ids), tokens, [-0.125] * n, [0] * n, "stop", self.engine_id)

    async def score(self, sequences, temperature):
        from asyncrl.gateway.engines import ScoringUnsupported

        raise ScoringUnsupported("a stub does not score")

    async def health(self) -> dict:
        return {"alive": True}


def run_headers(service) -> dict:
    """The run token on lifecycle calls, where the gateway asks for one."""
    credentials = getattr(service, "credentials", None)
    return {"Authorization": f"Bearer {credentials.run_token}"} if credentials is not None else {}


async def _session(http, url: str, lifecycle: dict, index: int, errors: list[str]) -> None:
    async def post(path: str, body: dict, headers: dict) -> dict | None:
        try:
            async with http.post(url + path, json=body, headers=headers) as response:
                if response.status == 200:
                    return await response.json()
                errors.append(f"session {index} {path}: {response.status} {(await response.text())[:200]}")
        except Exception as error:
            errors.append(f"session {index} {path}: {type(error).__name__}: {error}")
        return None

    opened = await post("/rollouts", {"task": "load", "group_id": f"g{index % 100}"}, lifecycle)
    if opened is None:
        return
    key = {"Authorization": f"Bearer {opened['api_key']}"}
    messages = [{"role": "user", "content": f"session {index}: what is 2+2? Check with python."}]
    for _ in range(1 + index % 2):
        reply = await post("/v1/chat/completions", {"messages": messages, "tools": TOOLS}, key)
        if reply is None:
            return
        message = reply["choices"][0]["message"]
        messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "4"}]
    await post(f"/rollouts/{opened['rollout_id']}/finish", {"reward": 1.0}, lifecycle)


async def _all_sessions(url: str, lifecycle: dict) -> list[str]:
    import aiohttp

    errors: list[str] = []
    connector = aiohttp.TCPConnector(limit=SESSIONS)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        await asyncio.gather(*(_session(http, url, lifecycle, i, errors) for i in range(SESSIONS)))
    return errors


def test_two_thousand_concurrent_sessions_without_an_error(tmp_path) -> None:
    gate = Gate(SESSIONS)
    store = open_store(tmp_path / "store.db")
    engines = [GatedStubEngine(f"stub-{i}", gate) for i in range(2)]
    with LiveGateway(make_service(store, engines, sampling=SamplingConfig(max_tokens=64))) as gateway:
        errors = asyncio.run(_all_sessions(gateway.url, run_headers(gateway.service)))
        assert not errors, f"{len(errors)} errors, first: {errors[:3]}"
        assert gate.all_arrived, f"only {gate.arrived} of {SESSIONS} first turns were in flight together"
        assert gateway.service.health()["rollouts_running"] == 0
    counts = store.counts()
    assert counts["ok"] == SESSIONS and counts["running"] == 0
    turns = [len(t.turns) for t in store.list()]
    assert sorted(turns) == sorted(1 + i % 2 for i in range(SESSIONS))
    store.close()
