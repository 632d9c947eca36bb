"""Benchmark, part of `asyncrl bench gateway`: what streaming and the Anthropic Messages route add.

- streaming: chat completions with `stream: true` through the gateway (child process, SQLite store,
  two streaming stub engines: the first token after FIRST_TOKEN_S, then one every PER_TOKEN_S, all
  asyncio.sleep), against a bare ASGI server that waits the same and sends chunks of the same shape
  (`_serve_direct_stream`), with the same aiohttp client and concurrency. Sessions arrive as in the
  overhead part of `asyncrl bench gateway`: each starts at a seeded random offset and thinks a seeded
  random time after each reply (`gateway._pauses`), the same on both sides. The same calls are also
  made in lockstep (every session at once, no thinking: one burst of STREAM_SESSIONS requests a round),
  reported as `*_burst_*`: there the requests queue for the gateway's per-request work, so that figure
  is the burst's, not a stream's. Time to first token is the time to the first chunk that carries
  content; per-token time is the time from it to the last content chunk over the tokens sent after it.
  Overheads are gateway minus direct, median over alternating repeats.
- Anthropic route: the same multi-turn tool session as an OpenAI chat (tools, tool calls echoed back,
  tool results) and as Anthropic messages (tool_use / tool_result blocks), against an instant stub
  engine, so each call is the gateway's own work; reported per call as the server's CPU time
  (all threads, /proc schedstat) and the wall time, and as the ratio messages / chat.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from .gateway import BENCH_SECRET, LIFECYCLE_HEADERS, THINK_S, TOOLS, Server, StubEngine, _listen, _pauses, _pct, _schedstat

STREAM_SESSIONS, STREAM_CALLS, STREAM_REPEATS = 16, 8, 3
FIRST_TOKEN_S, PER_TOKEN_S = 0.05, 0.005
ROUTE_SESSIONS, ROUTE_TURNS, ROUTE_REPEATS = 16, 6, 3
REPLY = "The answer is four: python printed 4 when it ran two plus two, so the sum is checked."


def _reply_ids() -> list[int]:
    from asyncrl.policy.tokenizer import EOS, build_tokenizer

    tokenizer = build_tokenizer()
    return [*tokenizer.encode(REPLY, add_special_tokens=False), tokenizer.convert_tokens_to_ids(EOS)]


class StreamingStub(StubEngine):
    """A stub engine that also streams: the first token after `first_s`, then one every `per_token_s`."""

    def __init__(self, engine_id: str, completion: list[int], first_s: float, per_token_s: float) -> None:
        super().__init__(engine_id, completion, first_s + per_token_s * (len(completion) - 1))
        self.first_s, self.per_token_s = first_s, per_token_s

    async def stream(self, prompt_token_ids, sampling, session_id):
        from asyncrl.records import GenerationResult, TokenDelta

        n = min(len(self.completion), sampling.max_tokens)
        for i, token in enumerate(self.completion[:n]):
            await asyncio.sleep(self.first_s if i == 0 else self.per_token_s)
            yield TokenDelta([token], [-0.125], [0])
        yield GenerationResult(
            "", list(prompt_token_ids), self.completion[:n], [-0.125] * n, [0] * n,
            "stop" if n == len(self.completion) else "length", self.engine_id, timings={"total": self.latency_s},
        )  # fmt: skip


def _serve_gateway(store: str, completion: str, first_s: float, per_token_s: float, ports) -> None:
    """Child process: the gateway over two stubs answering `completion` ("reply" text, or "tool" calls)."""
    from asyncrl.configs.schema import GatewayConfig, SamplingConfig
    from asyncrl.gateway.app import create_app
    from asyncrl.gateway.pool import EnginePool
    from asyncrl.gateway.service import GatewayService
    from asyncrl.gateway.store import open_store
    from asyncrl.policy.tokenizer import build_tokenizer

    from .gateway import _completion_ids

    ids = _reply_ids() if completion == "reply" else _completion_ids()
    config = GatewayConfig()
    pool = EnginePool(config)
    for i in range(2):
        pool.add_local(StreamingStub(f"stub-{i}", ids, first_s, per_token_s))
    service = GatewayService(open_store(store), build_tokenizer(), pool, config, SamplingConfig(max_tokens=64), secret=BENCH_SECRET)
    _listen(create_app(service), ports)


def _serve_direct_stream(first_s: float, per_token_s: float, ports) -> None:
    """Child process: a bare SSE server that reads each request, then sends chat.completion.chunk
    events timed like the stub engine: the floor the gateway's streaming is measured against."""
    from asyncrl.policy.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    pieces = [tokenizer.decode([t]) for t in _reply_ids()[:-1]]

    def chunk(delta: dict, finish: str | None = None) -> bytes:
        body = {"id": "chatcmpl-direct", "object": "chat.completion.chunk", "created": 0, "model": "direct",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}  # fmt: skip
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    async def app(scope, receive, send) -> None:
        request = b""
        while True:
            message = await receive()
            request += message.get("body", b"")
            if not message.get("more_body"):
                break
        json.loads(request)
        if scope["path"] != "/v1/chat/completions":
            body = json.dumps({"rollout_id": "0" * 32, "api_key": "direct"}).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": chunk({"role": "assistant", "content": ""}), "more_body": True})
        for i, piece in enumerate(pieces):
            await asyncio.sleep(first_s if i == 0 else per_token_s)
            await send({"type": "http.response.body", "body": chunk({"content": piece}), "more_body": True})
        await asyncio.sleep(per_token_s)  # the EOS step
        await send({"type": "http.response.body", "body": chunk({}, "stop") + b"data: [DONE]\n\n"})

    _listen(app, ports, lifespan="off")


async def _stream_calls(url: str, sessions: int, calls: int, think_s: float = 0.0) -> tuple[list[float], list[float], list[str]]:
    """(times to the first content chunk, mean time per token after it, errors) of streamed chats, each session
    paced by `_pauses` (think_s 0: all at once, back to back). Tokens are counted as characters of content (the
    tiny tokenizer's tokens are characters, and REPLY is ASCII): the gateway holds a space back until the next
    piece settles it, so its chunks are fewer than its tokens."""
    import aiohttp

    ttft: list[float] = []
    gaps: list[float] = []
    errors: list[str] = []

    async def session(http, index: int) -> None:
        pauses = _pauses(index, calls, think_s)
        await asyncio.sleep(pauses[0])
        async with http.post(url + "/rollouts", json={"task": "bench"}, headers=LIFECYCLE_HEADERS) as response:
            opened = await response.json()
        headers = {"Authorization": f"Bearer {opened['api_key']}"}
        messages = [{"role": "user", "content": "What is 2+2?"}]
        for call in range(calls):
            await asyncio.sleep(pauses[call] if call else 0.0)
            start, stamps, chars = time.perf_counter(), [], []
            async with http.post(url + "/v1/chat/completions", json={"messages": messages, "stream": True}, headers=headers) as response:
                if response.status != 200:
                    errors.append(f"{response.status}: {(await response.read())[:200]!r}")
                    return
                async for line in response.content:
                    text = _content(line) if line.startswith(b"data: {") else ""
                    if text:
                        stamps.append(time.perf_counter())
                        chars.append(len(text))
            if not stamps:
                errors.append("a stream without content")
                return
            ttft.append(stamps[0] - start)
            if len(stamps) > 1:
                gaps.append((stamps[-1] - stamps[0]) / sum(chars[1:]))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=sessions), timeout=aiohttp.ClientTimeout(total=600)) as http:
        await asyncio.gather(*(session(http, i) for i in range(sessions)))
    return ttft, gaps, errors


def _content(line: bytes) -> str:
    choices = json.loads(line[len(b"data: ") :]).get("choices") or [{}]
    return choices[0].get("delta", {}).get("content") or ""


Streamed = dict[str, tuple[list[float], list[float]]]
"""Arrival model ("paced", "burst") -> (times to first token, per-token times) of one server's run."""


def _streamed(server: Server) -> Streamed:
    runs: Streamed = {}
    with server as url:
        asyncio.run(_stream_calls(url, STREAM_SESSIONS, 1))  # warm-up
        for mode, think_s in (("paced", THINK_S), ("burst", 0.0)):
            ttft, gaps, errors = asyncio.run(_stream_calls(url, STREAM_SESSIONS, STREAM_CALLS, think_s))
            assert not errors, errors[:3]
            runs[mode] = (ttft, gaps)
    return runs


def streaming(tmp: str) -> dict:
    """Time to first token and per-token time, gateway vs direct, paced and in lockstep (see the module doc)."""
    runs: dict[str, list[Streamed]] = {"gateway": [], "direct": []}
    for repeat in range(STREAM_REPEATS):
        for side in ("gateway", "direct") if repeat % 2 == 0 else ("direct", "gateway"):
            if side == "gateway":
                server = Server(_serve_gateway, str(Path(tmp) / f"stream-{repeat}.db"), "reply", FIRST_TOKEN_S, PER_TOKEN_S)
            else:
                server = Server(_serve_direct_stream, FIRST_TOKEN_S, PER_TOKEN_S)
            runs[side].append(_streamed(server))
    results: dict = {}
    for mode, suffix in (("paced", ""), ("burst", "_burst")):
        for q in (50, 99):
            g = [_pct(run[mode][0], q) for run in runs["gateway"]]
            d = [_pct(run[mode][0], q) for run in runs["direct"]]
            results[f"stream_ttft_overhead{suffix}_p{q}_ms"] = round(1000 * statistics.median(a - b for a, b in zip(g, d, strict=True)), 3)
            results[f"stream_ttft_gateway{suffix}_p{q}_ms"] = round(1000 * statistics.median(g), 3)
            results[f"stream_ttft_direct{suffix}_p{q}_ms"] = round(1000 * statistics.median(d), 3)
        gap = {side: statistics.median(statistics.median(run[mode][1]) for run in sides) for side, sides in runs.items()}
        results[f"stream_per_token_overhead{suffix}_ms"] = round(1000 * (gap["gateway"] - gap["direct"]), 3)
        results[f"stream_per_token_gateway{suffix}_ms"] = round(1000 * gap["gateway"], 3)
    results["stream_setup"] = {
        "sessions": STREAM_SESSIONS, "calls_per_session": STREAM_CALLS, "repeats": STREAM_REPEATS,
        "first_token_s": FIRST_TOKEN_S, "per_token_s": PER_TOKEN_S, "reply_tokens": len(_reply_ids()),
        "think_s": THINK_S, "arrivals": "paced: seeded random start offsets and think times (bench gateway's); burst: all at once",
    }  # fmt: skip
    return results


def _anthropic_tools() -> list[dict]:
    functions: list[Any] = [t["function"] for t in TOOLS]
    return [{"name": f["name"], "input_schema": f["parameters"]} for f in functions]


async def _route_session(http, url: str, route: str, turns: int, walls: list[float], errors: list[str]) -> None:
    async with http.post(url + "/rollouts", json={"task": "bench"}, headers=LIFECYCLE_HEADERS) as response:
        opened = await response.json()
    key = opened["api_key"]
    question = "What is 2+2? Check with python."
    if route == "chat":
        path, headers = "/v1/chat/completions", {"Authorization": f"Bearer {key}"}
        body: dict = {"messages": [{"role": "system", "content": "You run python."}, {"role": "user", "content": question}], "tools": TOOLS}
    else:
        path, headers = "/v1/messages", {"x-api-key": key, "anthropic-version": "2023-06-01"}
        body = {
            "system": "You run python.",
            "messages": [{"role": "user", "content": question}],
            "tools": _anthropic_tools(),
            "max_tokens": 64,
        }
    for _ in range(turns):
        start = time.perf_counter()
        async with http.post(url + path, json=body, headers=headers) as response:
            raw = await response.read()
        walls.append(time.perf_counter() - start)
        if response.status != 200:
            errors.append(f"{route} {response.status}: {raw[:200]!r}")
            return
        reply = json.loads(raw)
        if route == "chat":
            message = reply["choices"][0]["message"]
            body["messages"] += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "4"}]
        else:
            use = next(block for block in reply["content"] if block["type"] == "tool_use")
            body["messages"] += [
                {"role": "assistant", "content": reply["content"]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "4"}]},
            ]


async def _route_calls(url: str, route: str, sessions: int, turns: int) -> tuple[list[float], list[str]]:
    import aiohttp

    walls: list[float] = []
    errors: list[str] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=sessions), timeout=aiohttp.ClientTimeout(total=600)) as http:
        await asyncio.gather(*(_route_session(http, url, route, turns, walls, errors) for _ in range(sessions)))
    return walls, errors


def anthropic_route(tmp: str) -> dict:
    """Per-call server CPU and wall of the same session on /v1/messages and /v1/chat/completions."""
    cpu: dict[str, list[float]] = {"chat": [], "messages": []}
    wall: dict[str, list[float]] = {"chat": [], "messages": []}
    server = Server(_serve_gateway, str(Path(tmp) / "routes.db"), "tool", 0.0, 0.0)
    with server as url:
        pid = server.process.pid
        assert pid is not None  # entering `server` started it
        for repeat in range(ROUTE_REPEATS):
            for route in ("chat", "messages") if repeat % 2 == 0 else ("messages", "chat"):
                asyncio.run(_route_calls(url, route, ROUTE_SESSIONS, 1))  # warm-up of this route
                before = _schedstat(pid)
                walls, errors = asyncio.run(_route_calls(url, route, ROUTE_SESSIONS, ROUTE_TURNS))
                after = _schedstat(pid)
                assert not errors, errors[:3]
                cpu[route].append((after[0] - before[0]) / len(walls))
                wall[route].append(_pct(walls, 50))
    chat_cpu, messages_cpu = statistics.median(cpu["chat"]), statistics.median(cpu["messages"])
    return {
        "chat_cpu_ms_per_call": round(1000 * chat_cpu, 3),
        "messages_cpu_ms_per_call": round(1000 * messages_cpu, 3),
        "messages_over_chat_cpu": round(messages_cpu / chat_cpu, 3),
        "chat_wall_p50_ms": round(1000 * statistics.median(wall["chat"]), 3),
        "messages_wall_p50_ms": round(1000 * statistics.median(wall["messages"]), 3),
        "route_setup": {"sessions": ROUTE_SESSIONS, "turns": ROUTE_TURNS, "repeats": ROUTE_REPEATS, "engine": "instant stub"},
    }
