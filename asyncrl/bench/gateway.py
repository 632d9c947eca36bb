"""Benchmark: what the TITO gateway adds to a generation call, how many sessions it holds, and how
fast it records turns.

To isolate the gateway's own cost, the engines behind it are `StubEngine`s: the engine handle
interface, answering a fixed tool-call completion after a fixed delay (asyncio.sleep: no CPU), so
a real engine's compute neither hides nor inflates the gateway's. The gateway runs in a child
process (uvicorn, as `asyncrl serve` runs it, SQLite store, 2 stub engines); clients run here with
aiohttp, so client and server do not share an interpreter lock.

- overhead (64 concurrent sessions): each session is a multi-turn tool chat (the agent echoes the
  reply, adds a tool result, "runs the tool" for THINK_S, asks again). Per request, the wall time
  through the gateway; then the same sessions calling a StubEngine directly (same delays, same
  concurrency). overhead_pXX_ms = pXX(gateway) - pXX(direct). Repeated, alternating, median kept.
  The engine takes ENGINE_LATENCY_S a turn (short for agentic turns, which decode for seconds), so
  64 sessions offer ~51 requests/s: the gateway's cost per request plus the queueing that load
  causes, not a saturated queue. `<store>_turns_per_s` below is the saturation point.
  The server-side part (recorded `gateway_s - engine_call_s`) is reported beside it.
- sessions_1000_ok: 1000 rollouts opened, then all running 3-turn chats at once against a 1 s
  engine, so ~1000 requests are in flight together; true when every call succeeded.
- <store>_turns_per_s: recorded turns per second through the gateway (64 sessions back to back,
  instant engine), SQLite and Redis; `*_store_appends_per_s` is the store alone, for scale.
- stream_* and the Anthropic route (`gateway_routes`): time to first token and per-token time of
  streamed chats over a bare SSE server's, and the Messages route's server CPU per call over chat
  completions' for the same session.

    asyncrl bench gateway --json bench-gateway.json
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import platform
import random
import statistics
import time
import uuid
from pathlib import Path
from tempfile import TemporaryDirectory

from asyncrl.configs.schema import GatewayConfig, RedisStoreConfig, RunConfig, SamplingConfig
from asyncrl.gateway.auth import Credentials
from asyncrl.records import ScoreResult

SESSIONS, TURNS, REPEATS = 64, 6, 3
ENGINE_LATENCY_S, THINK_S = 1.0, 0.25
BIG_SESSIONS, BIG_TURNS, BIG_LATENCY_S = 1000, 3, 1.0
THROUGHPUT_TURNS = 8
COMPLETION = "<tool_call>python<arg_key>code</arg_key><arg_value>print(2+2)</arg_value></tool_call><|endoftext|>"
TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}]


class StubEngine:
    """An engine behind the handle interface that answers COMPLETION after `latency_s`."""

    def __init__(self, engine_id: str, completion: list[int], latency_s: float) -> None:
        self.engine_id, self.completion, self.latency_s = engine_id, completion, latency_s
        self.active = self.max_active = 0

    async def generate(self, prompt_token_ids, sampling, session_id):
        from asyncrl.records import GenerationResult

        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
            n = min(len(self.completion), sampling.max_tokens)
            return GenerationResult(
                "", list(prompt_token_ids), self.completion[:n], [-0.125] * n, [0] * n,
                "stop" if n == len(self.completion) else "length", self.engine_id, timings={"total": self.latency_s},
            )  # fmt: skip
        finally:
            self.active -= 1

    async def score(self, sequences: list[list[int]], temperature: float) -> ScoreResult:
        from asyncrl.gateway.engines import ScoringUnsupported

        raise ScoringUnsupported(f"engine {self.engine_id} is a generation stub")

    async def health(self) -> dict:
        return {"alive": True, "max_concurrent": self.max_active}


BENCH_SECRET = b"asyncrl bench gateway, loopback only"
"""The bench gateway's secret, fixed so the sessions can send its run token as a scheduler would."""
LIFECYCLE_HEADERS = {"Authorization": f"Bearer {Credentials.from_secret(BENCH_SECRET).run_token}"}


def _completion_ids() -> list[int]:
    from asyncrl.policy.tokenizer import build_tokenizer

    return build_tokenizer().encode(COMPLETION, add_special_tokens=False)


def _serve(store: str, namespace: str, latency_s: float, ports) -> None:
    """Child process: the gateway with two stub engines, on a free loopback port."""
    from asyncrl.gateway.app import create_app
    from asyncrl.gateway.pool import EnginePool
    from asyncrl.gateway.service import GatewayService
    from asyncrl.gateway.store import open_store
    from asyncrl.policy.tokenizer import build_tokenizer

    config = GatewayConfig()
    pool = EnginePool(config)
    for i in range(2):
        pool.add_local(StubEngine(f"stub-{i}", _completion_ids(), latency_s))
    service = GatewayService(
        open_store(store, namespace=namespace), build_tokenizer(), pool, config, SamplingConfig(max_tokens=64), secret=BENCH_SECRET
    )
    _listen(create_app(service), ports)


def _listen(app, ports, **options) -> None:
    """Serve `app` on a free loopback port (sent on `ports`) as `asyncrl serve` does: uvicorn (httptools
    where installed), uvloop where installed, the start-up heap frozen out of the garbage collector."""
    import uvicorn

    from asyncrl.gateway.app import run_loop, settle_heap

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", backlog=4096, **options))

    async def main():
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        ports.put(server.servers[0].sockets[0].getsockname()[1])
        await task

    settle_heap()
    run_loop(main())


def _serve_direct(latency_s: float, ports) -> None:
    """Child process: the direct side, a bare engine behind the same HTTP server. It reads and parses
    each request, waits `latency_s` and answers with a chat completion shaped like the gateway's, so
    the client does the same work on both sides; nothing is rendered, routed or recorded."""
    from asyncrl.gateway import api
    from asyncrl.gateway.toolcalls import parse_completion
    from asyncrl.policy.tokenizer import build_tokenizer
    from asyncrl.records import GenerationResult

    ids = _completion_ids()
    parsed = parse_completion(ids, build_tokenizer(), TOOLS, lambda: f"call_{0:024x}")
    result = GenerationResult("", [], ids, [-0.125] * len(ids), [0] * len(ids), "stop", "direct")
    reply = api.chat_response("direct", "0" * 32, 0, 0, parsed.message(), parsed.finish_reason("stop"), result, 100, 0, None)
    bodies = {
        "/v1/chat/completions": json.dumps(reply).encode(),
        "/rollouts": json.dumps({"rollout_id": "0" * 32, "api_key": "direct"}).encode(),
    }

    async def app(scope, receive, send) -> None:
        request = b""
        while True:
            message = await receive()
            request += message.get("body", b"")
            if not message.get("more_body"):
                break
        json.loads(request)  # an engine reads its request
        path = scope["path"]
        if path == "/v1/chat/completions":
            await asyncio.sleep(latency_s)
        body = bodies.get(path, b"{}")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    _listen(app, ports, lifespan="off")


class Server:
    """A server child process (`_serve` or `_serve_direct`) for the duration of a `with` block."""

    def __init__(self, target, *args) -> None:
        context = multiprocessing.get_context("spawn")
        self.ports = context.Queue()
        self.process = context.Process(target=target, args=(*args, self.ports), daemon=True)

    def __enter__(self) -> str:
        self.process.start()
        return f"http://127.0.0.1:{self.ports.get(timeout=120)}"

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.join(30)


def Gateway(store: str, latency_s: float, namespace: str = "bench") -> Server:
    """The gateway with two stub engines, in a child process."""
    return Server(_serve, store, namespace, latency_s)


def _pauses(index: int, turns: int, think_s: float) -> list[float]:
    """A session's start offset, then its think time after each turn. Seeded per session, so the
    gateway run and the direct run see the same arrivals; random, because sessions that all start
    together and think alike arrive as one burst and measure the burst, not the gateway."""
    rng = random.Random(index)
    if not think_s:
        return [0.0] * (turns + 1)
    return [rng.uniform(0, ENGINE_LATENCY_S + think_s)] + [rng.uniform(0, 2 * think_s) for _ in range(turns)]


async def _session(http, url: str, turns: int, think_s: float, walls: list[float], errors: list[str], index: int = 0) -> None:
    pauses = _pauses(index, turns, think_s)
    await asyncio.sleep(pauses[0])
    async with http.post(url + "/rollouts", json={"task": "bench"}, headers=LIFECYCLE_HEADERS) as response:
        opened = await response.json()
    headers = {"Authorization": f"Bearer {opened['api_key']}"}
    messages = [{"role": "system", "content": "You run python."}, {"role": "user", "content": "What is 2+2? Check with python."}]
    for turn in range(turns):
        start = time.perf_counter()
        async with http.post(url + "/v1/chat/completions", json={"messages": messages, "tools": TOOLS}, headers=headers) as response:
            body = await response.read()
        walls.append(time.perf_counter() - start)
        if response.status != 200:
            errors.append(f"{response.status}: {body[:200]!r}")
            return
        reply = json.loads(body)["choices"][0]["message"]
        messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "4"}]
        await asyncio.sleep(pauses[turn + 1])
    async with http.post(f"{url}/rollouts/{opened['rollout_id']}/finish", json={"reward": 1.0}, headers=LIFECYCLE_HEADERS) as response:
        await response.read()


async def _through_gateway(url: str, sessions: int, turns: int, think_s: float) -> tuple[list[float], list[str], float]:
    # aiohttp, not httpx: httpx's pool cost ~15 ms of client CPU a request at 64 connections here,
    # which would have been measured as gateway latency.
    import aiohttp

    walls: list[float] = []
    errors: list[str] = []
    connector = aiohttp.TCPConnector(limit=sessions)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        start = time.perf_counter()
        await asyncio.gather(*(_session(http, url, turns, think_s, walls, errors, i) for i in range(sessions)))
        return walls, errors, time.perf_counter() - start


async def _in_process(sessions: int, turns: int, think_s: float, latency_s: float) -> list[float]:
    from asyncrl.records import SamplingParams

    stub, walls = StubEngine("direct", _completion_ids(), latency_s), []
    sampling = SamplingParams(max_tokens=64)

    async def session(prompt: list[int], index: int) -> None:
        pauses = _pauses(index, turns, think_s)
        await asyncio.sleep(pauses[0])
        for turn in range(turns):
            start = time.perf_counter()
            result = await stub.generate(prompt, sampling, "s")
            walls.append(time.perf_counter() - start)
            prompt = prompt + result.token_ids + [5] * 12
            await asyncio.sleep(pauses[turn + 1])

    await asyncio.gather(*(session([4] * 60, i) for i in range(sessions)))
    return walls


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def _server_overhead(store_path: str) -> list[float]:
    from asyncrl.gateway.store import open_store

    store = open_store(store_path)
    turns = [turn for t in store.list() for turn in t.turns]
    store.close()
    return [turn.timings["gateway_s"] - turn.timings["engine_call_s"] for turn in turns]


def _store_appends_per_s(address: str, namespace: str, n: int = 2000) -> float:
    from concurrent.futures import ThreadPoolExecutor

    from asyncrl.gateway.store import open_store
    from asyncrl.records import Turn

    store = open_store(address, namespace=namespace)
    ids = [store.open("bench") for _ in range(64)]
    completion = _completion_ids()
    turn = lambda i: Turn(ids[i % 64], [7] * 300, completion, [-0.125] * len(completion), [0] * len(completion))  # noqa: E731
    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:  # the gateway's store thread pool
        list(pool.map(lambda i: store.append(turn(i)), range(n)))
    rate = n / (time.perf_counter() - start)
    store.close()
    return rate


def _schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of all of `pid`'s threads so far;
    zeros where the kernel does not report them (Linux /proc/PID/task/*/schedstat)."""
    run = wait = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            fields = stat.read_text().split()
        except OSError:  # a thread that ended meanwhile
            continue
        run, wait = run + int(fields[0]), wait + int(fields[1])
    return run / 1e9, wait / 1e9


def _http_walls(server: Server, cpu: list[tuple[float, float]] | None = None) -> list[float]:
    """Request walls of the overhead workload through `server` (after a one-turn warm-up). `cpu`
    gets the server process's (CPU seconds, run-queue wait seconds) per request of that workload."""
    with server as url:
        asyncio.run(_through_gateway(url, SESSIONS, 1, 0.0))  # warm-up: template compile, connections
        pid = server.process.pid
        assert pid is not None  # entering `server` started it
        before = _schedstat(pid)
        walls, errors, _ = asyncio.run(_through_gateway(url, SESSIONS, TURNS, THINK_S))
        after = _schedstat(pid)
    assert not errors, errors[:3]
    if cpu is not None:
        cpu.append(((after[0] - before[0]) / len(walls), (after[1] - before[1]) / len(walls)))
    return walls


def run(config: RunConfig, json_path: str | None = None) -> dict:
    from asyncrl.gateway.app import settle_heap

    _completion_ids()  # imports the tokenizer stack here, before the heap is settled
    settle_heap()  # the client's own collector pauses would land on whichever side is running
    results: dict = {}
    with TemporaryDirectory() as tmp:
        results.update(_overhead(tmp))
        results.update(_sessions_1000(tmp))
        results.update(_store_throughput(config, tmp))

        from . import gateway_routes

        results.update(gateway_routes.streaming(tmp))
        results.update(gateway_routes.anthropic_route(tmp))

    results["setup"] = {
        "sessions": SESSIONS, "turns": TURNS, "repeats": REPEATS, "engine_latency_s": ENGINE_LATENCY_S,
        "think_s": THINK_S, "offered_load_req_s": round(SESSIONS / (ENGINE_LATENCY_S + THINK_S), 1),
        "engines": "2 StubEngine (asyncio.sleep)", "store": "sqlite (overhead, sessions)", "client": "aiohttp, separate process",
        "direct": "bare ASGI engine stub on the same uvicorn, same client and requests",
        "machine": platform.machine(), "python": platform.python_version(),
    }  # fmt: skip
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
    return results


def _overhead(tmp: str) -> dict:
    """overhead_pXX_ms and what it is made of: the overhead workload through the gateway, against the direct
    side and an in-process engine, REPEATS times, sides alternating; the server processes' CPU per request."""
    results: dict = {}
    sides: dict[str, list[list[float]]] = {"gateway": [], "direct": [], "in_process": []}
    server: list[float] = []
    cpu: dict[str, list[tuple[float, float]]] = {"gateway": [], "direct": []}
    for repeat in range(REPEATS):
        store = str(Path(tmp) / f"overhead-{repeat}.db")
        order = ("gateway", "direct") if repeat % 2 == 0 else ("direct", "gateway")
        for side in order:
            if side == "gateway":
                sides["gateway"].append(_http_walls(Gateway(store, ENGINE_LATENCY_S), cpu["gateway"]))
            else:
                sides["direct"].append(_http_walls(Server(_serve_direct, ENGINE_LATENCY_S), cpu["direct"]))
        sides["in_process"].append(asyncio.run(_in_process(SESSIONS, TURNS, THINK_S, ENGINE_LATENCY_S)))
        server += _server_overhead(store)
    for q in (50, 99):
        pct = {name: [_pct(walls, q) for walls in runs] for name, runs in sides.items()}
        overheads = [g - d for g, d in zip(pct["gateway"], pct["direct"], strict=True)]
        results[f"overhead_p{q}_ms"] = round(1000 * statistics.median(overheads), 3)
        results[f"server_overhead_p{q}_ms"] = round(1000 * _pct(server, q), 3)
        results[f"gateway_p{q}_ms"] = round(1000 * statistics.median(pct["gateway"]), 3)
        results[f"direct_p{q}_ms"] = round(1000 * statistics.median(pct["direct"]), 3)
        # The pre-2026-11-29 method (an in-process engine call as the baseline) for comparison:
        # it also charges the client's HTTP and JSON work and the loopback round trip to the gateway.
        inproc = [g - d for g, d in zip(pct["gateway"], pct["in_process"], strict=True)]
        results[f"overhead_vs_in_process_p{q}_ms"] = round(1000 * statistics.median(inproc), 3)
    # Process CPU time per request (all threads) and time spent runnable but waiting for a core:
    # the first is the server's own cost, the second what a busy machine added to it.
    for name, samples in cpu.items():
        results[f"{name}_cpu_ms_per_request"] = round(1000 * statistics.median(c for c, _ in samples), 3)
        results[f"{name}_cpu_wait_ms_per_request"] = round(1000 * statistics.median(w for _, w in samples), 3)
    results["overhead_repeats_ms"] = {
        f"p{q}": [round(1000 * (_pct(g, q) - _pct(d, q)), 2) for g, d in zip(sides["gateway"], sides["direct"], strict=True)]
        for q in (50, 99)
    }
    return results


def _sessions_1000(tmp: str) -> dict:
    """sessions_1000_ok: BIG_SESSIONS rollouts' chats at once against a slow engine, every call answered."""
    with Gateway(str(Path(tmp) / "sessions.db"), BIG_LATENCY_S) as url:
        walls, errors, elapsed = asyncio.run(_through_gateway(url, BIG_SESSIONS, BIG_TURNS, THINK_S))
        import httpx

        engines = httpx.get(url + "/health").json()["engines"]
    return {
        "sessions_1000_ok": not errors and len(walls) == BIG_SESSIONS * BIG_TURNS,
        "sessions_1000": {
            "errors": len(errors), "first_errors": errors[:3], "calls": len(walls), "wall_s": round(elapsed, 2),
            "p50_ms": round(1000 * _pct(walls, 50), 1), "p99_ms": round(1000 * _pct(walls, 99), 1),
            "max_in_flight_per_engine": [e["health"].get("max_concurrent") for e in engines],
        },
    }  # fmt: skip


def _store_throughput(config: RunConfig, tmp: str) -> dict:
    """<store>_turns_per_s through the gateway over an instant engine, and the store's own appends per second, for
    SQLite and Redis (a namespace of its own, dropped after)."""
    results: dict = {}
    redis_namespace = f"bench-gateway-{uuid.uuid4().hex}"
    redis_url = config.store.url if isinstance(config.store, RedisStoreConfig) else RedisStoreConfig().url
    for name, address, namespace in (
        ("sqlite", str(Path(tmp) / "throughput.db"), "bench"),
        ("redis", redis_url, redis_namespace),
    ):
        with Gateway(address, 0.0, namespace) as url:
            asyncio.run(_through_gateway(url, SESSIONS, 1, 0.0))
            walls, errors, elapsed = asyncio.run(_through_gateway(url, SESSIONS, THROUGHPUT_TURNS, 0.0))
            assert not errors, errors[:3]
        results[f"{name}_turns_per_s"] = round(len(walls) / elapsed, 1)
        results[f"{name}_store_appends_per_s"] = round(_store_appends_per_s(address, namespace + "-raw"), 1)
    _drop_redis_namespace(redis_url, redis_namespace)
    return results


def _drop_redis_namespace(url: str, namespace: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    for prefix in (namespace, namespace + "-raw"):
        keys = list(client.scan_iter(f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
