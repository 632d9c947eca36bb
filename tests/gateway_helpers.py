"""Shared by the gateway tests: a real gateway over loopback (uvicorn in a thread) in front of real
tiny engines, and a policy whose weights are set so it writes a tool call.

`ScriptedEngine` is an engine handle that writes exact replies, for tests of what goes around the
policy (environments, evaluation); `KVEngine` an engine whose reply carries KV provenance (a request that
ran across weight pushes), for the recording and routing tests.

The scripted policy is a real model run by the real engine: every layer's output projections are
zero, so the final hidden state is the last token's embedding and the model is a bigram table. Its
embeddings and LM head are set so that after `<|assistant|>` it writes the SCRIPT below, each step
with a logit margin of SHARPNESS: at temperature 1 it strays from the script with probability
~(vocabulary - 1) * exp(-SHARPNESS), about 3e-7 per token (greedy, never), and the log-probs it reports are real (tiny, negative) numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time

import httpx
import openai
import torch
import uvicorn

from asyncrl.configs.schema import EmbeddedRolloutConfig, GatewayConfig, SamplingConfig, TinyModelConfig
from asyncrl.gateway.app import create_app, gateway_server
from asyncrl.gateway.engines import EngineFailure, LocalEngine, ScoringUnsupported, engine_app
from asyncrl.gateway.pool import EnginePool
from asyncrl.gateway.service import GatewayService
from asyncrl.policy.tiny import build_tiny_model
from asyncrl.policy.tokenizer import (
    ARG_KEY_CLOSE,
    ARG_KEY_OPEN,
    ARG_VALUE_CLOSE,
    ARG_VALUE_OPEN,
    ASSISTANT,
    EOS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    build_tokenizer,
)  # fmt: skip
from asyncrl.records import GenerationResult, SamplingParams, TokenDelta

SHAPE = dict(arch="qwen3", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=32, max_position_embeddings=1024)
SCRIPT = [ASSISTANT, TOOL_CALL_OPEN, "f", ARG_KEY_OPEN, "a", ARG_KEY_CLOSE, ARG_VALUE_OPEN, "7", ARG_VALUE_CLOSE, TOOL_CALL_CLOSE, EOS]
SHARPNESS = 20.0
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}]

TOKENIZER = build_tokenizer()


def scripted_model(script: list[str] = SCRIPT):
    model = build_tiny_model(TinyModelConfig(**SHAPE), seed=0).eval()
    ids = [TOKENIZER.convert_tokens_to_ids(t) for t in script]
    hidden = SHAPE["hidden_size"]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        embed[:, : len(ids)] = 0.0  # the script's dimensions; other tokens live in the rest
        head.zero_()
        for dim, (token, successor) in enumerate(itertools.pairwise(ids)):
            embed[token] = 0.0
            embed[token, dim] = 1.0
            head[successor, dim] = SHARPNESS / hidden**0.5  # RMSNorm scales a one-hot row to sqrt(hidden)
    return model


def make_engine(engine_id: str = "e0", model=None):
    from asyncrl.rollout import EmbeddedEngine

    config = EmbeddedRolloutConfig(device="cpu", torch_threads=1, max_num_seqs=16)
    return EmbeddedEngine(model if model is not None else scripted_model(), config, engine_id=engine_id)


@contextlib.contextmanager
def one_token_per_delta(engine, wait_s: float = 60.0):
    """While inside, the engine takes a step only once every stream's last delta has been taken by its
    caller, so each step's token reaches the gateway as a delta of its own however loaded the machine is
    (the front merges the steps of a caller that fell behind, by design). `wait_s` is a safety valve."""
    advance = engine.advance

    def drained() -> bool:
        with engine._cv:
            sinks = [sink for _, sink in engine._streams.values()]
        return all(not sink._delta.token_ids for sink in sinks)

    def gated_advance():
        deadline = time.monotonic() + wait_s
        while not drained() and time.monotonic() < deadline:
            time.sleep(0.001)
        return advance()

    engine.advance = gated_advance  # the front steps through the instance's attribute
    try:
        yield
    finally:
        del engine.advance


class ManualClock:
    """A clock that moves only when told: engine leases expire by it, never by how slow the machine is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_service(store, handles, *, sampling: SamplingConfig | None = None, clock: ManualClock | None = None, **gateway) -> GatewayService:
    """`clock`: the engine registry's (leases and heartbeats), by default the real one."""
    config = GatewayConfig(**gateway)
    pool = EnginePool(config) if clock is None else EnginePool(config, clock=clock)
    for handle in handles:
        pool.add_local(handle if not hasattr(handle, "step") else LocalEngine(handle))
    return GatewayService(store, TOKENIZER, pool, config, sampling or SamplingConfig(max_tokens=16))


class LiveGateway:
    """The gateway app served by uvicorn on a free loopback port, in a background thread.

    `http` is the run's own client: it carries the run token, as the scheduler's would (a request with
    its own Authorization header, e.g. a rollout key, sends that instead). `run_token` and
    `engine_token` are the gateway's tokens, for requests that need to choose."""

    def __init__(self, service: GatewayService, *, heartbeats: bool = True) -> None:
        self.service = service
        self.run_token, self.engine_token = service.credentials.run_token, service.credentials.engine_token
        self.server = gateway_server(create_app(service, heartbeats=heartbeats), service.config, host="127.0.0.1", port=0)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveGateway:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {self.run_token}"})
        if self.service.replicas is not None:  # one of several replicas (gateway/replicas.py): announce it
            self.await_on_loop(self.service.replicas.start(self.url, self.service.io))
        return self

    def __exit__(self, *exc) -> None:
        if self.service.replicas is not None:
            self.await_on_loop(self.service.replicas.withdraw(self.service.io))
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.service.close()

    def open(self, task: str = "task", group_id: str = "g", metadata: dict | None = None) -> tuple[str, str]:
        response = self.http.post("/rollouts", json={"task": task, "group_id": group_id, "metadata": metadata or {}})
        response.raise_for_status()
        return response.json()["rollout_id"], response.json()["api_key"]

    def openai(self, api_key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def on_loop(self, fn, *args):
        """Run `fn(*args)` on the server's event loop (the pool and registry belong to it)."""

        async def call():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout=10)

    def await_on_loop(self, coroutine):
        """Await `coroutine` on the server's event loop."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.server.servers[0].get_loop()


class EngineServer:
    """A real engine served over HTTP by `engine_app`, as on another machine: `with EngineServer(engine) as
    address`, or `start()` (returns the address) and `stop()`."""

    def __init__(self, engine) -> None:
        self.server = uvicorn.Server(uvicorn.Config(engine_app(engine), host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> str:
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "the engine server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def live_engines(gateway: LiveGateway) -> set[str]:
    """The ids of the engines a gateway routes to now, from its /health."""
    return {engine["engine_id"] for engine in httpx.get(gateway.url + "/health").json()["engines"]}


class Pausable(LocalEngine):
    """A real in-process engine that a test can hold mid-request, or kill: a killed engine never
    answers the requests it holds and fails its health checks, as a crashed process would."""

    def __init__(self, engine, engine_id: str | None = None) -> None:
        super().__init__(engine, engine_id)
        self.started, self._paused, self.killed = threading.Event(), threading.Event(), threading.Event()
        self.calls = 0

    def pause(self) -> None:
        self.started.clear()
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def kill(self) -> None:
        self.killed.set()

    async def _admit(self) -> None:
        """Hold a request while paused; a killed engine never answers it."""
        self.calls += 1
        self.started.set()
        while self._paused.is_set() and not self.killed.is_set():
            await asyncio.sleep(0.005)
        if self.killed.is_set():
            await asyncio.Event().wait()

    async def generate(self, prompt_token_ids, sampling, session_id):
        await self._admit()
        return await super().generate(prompt_token_ids, sampling, session_id)

    async def stream(self, prompt_token_ids, sampling, session_id):
        await self._admit()
        async with contextlib.aclosing(super().stream(prompt_token_ids, sampling, session_id)) as items:
            async for item in items:
                yield item

    async def health(self) -> dict:
        if self.killed.is_set():
            raise ConnectionError(f"engine {self.engine_id} is gone")
        return await super().health()


class ScriptedEngine:
    """An engine handle that writes `reply(prompt text)` (cut at the request's max_tokens) and keeps
    every request's prompt tokens and sampling options, for tests that need exact replies."""

    def __init__(self, reply, engine_id: str = "scripted") -> None:
        self.reply, self.engine_id = reply, engine_id
        self.requests: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, prompt_token_ids, sampling, session_id):
        self.requests.append((list(prompt_token_ids), sampling))
        tokens = TOKENIZER.encode(self.reply(TOKENIZER.decode(prompt_token_ids)), add_special_tokens=False)[: sampling.max_tokens]
        finish = "stop" if tokens and tokens[-1] == TOKENIZER.eos_token_id else "length"
        zeros = [0.0] * len(tokens)
        return GenerationResult("scripted", list(prompt_token_ids), tokens, zeros, [0] * len(tokens), finish, engine_id=self.engine_id)

    async def score(self, sequences, temperature):
        raise ScoringUnsupported("a scripted engine does not score")

    async def health(self) -> dict:
        return {}


class Replier:
    """An engine handle that samples a fixed reply, streamed a token per delta; with `hold`, the stream stops
    after that many tokens until it is closed (`closed` is set when it is: the request was aborted)."""

    def __init__(self, reply_ids: list[int], engine_id: str = "replier", hold: int | None = None) -> None:
        self.reply_ids, self.engine_id, self.hold = reply_ids, engine_id, hold
        self.fail: int | None = None
        """Fail the stream (the engine died) after this many tokens."""
        self.closed = threading.Event()

    async def generate(self, prompt_token_ids, sampling, session_id) -> GenerationResult:
        ids = self.reply_ids[: sampling.max_tokens]
        finish = "stop" if len(ids) < sampling.max_tokens or ids[-1:] == self.reply_ids[-1:] else "length"
        logprobs = [-0.125 * (i + 1) for i in range(len(ids))]
        return GenerationResult("r", list(prompt_token_ids), ids, logprobs, [3] * len(ids), finish, engine_id=self.engine_id)

    async def stream(self, prompt_token_ids, sampling, session_id):
        try:
            result = await self.generate(prompt_token_ids, sampling, session_id)
            for i, token in enumerate(result.token_ids):
                if i == self.hold:
                    await asyncio.Event().wait()
                if i == self.fail:
                    raise EngineFailure("the engine died mid-stream")
                yield TokenDelta([token], [result.logprobs[i]], [3])
                await asyncio.sleep(0)
            yield result
        finally:
            self.closed.set()

    async def score(self, sequences, temperature):
        raise ScoringUnsupported("a replier does not score")

    async def health(self) -> dict:
        return {}


def serve_banner(process) -> tuple[str, str]:
    """(base URL, banner) of an `asyncrl serve` subprocess (stdout a text pipe), read up to its Ctrl-C line."""
    import re

    banner = []
    for line in process.stdout:
        banner.append(line)
        if "Ctrl-C" in line:
            break
    url = re.search(r"listening on (http://127\.0\.0\.1:\d+)", "".join(banner))
    assert url, "".join(banner)
    return url[1], "".join(banner)


KV_REPLY = [*TOKENIZER.encode("sunny", add_special_tokens=False), TOKENIZER.eos_token_id]
SAMPLED_BY = 7
KV_VERSIONS = [5, 5, 6, 6, 7, 7]
"""What `KVEngine`'s reply attended to: KV of versions 5 to 7 under weights of version 7, as a request that ran
across two pushes under `rollout.kv_on_push: keep` records it."""


class KVEngine:
    """An engine with the verbs `LocalEngine` and `engine_app` call, replying KV_REPLY sampled by version SAMPLED_BY
    over KV of KV_VERSIONS (none with `records_kv=False`, as vLLM records none). It keeps the session id of every
    request; with `hold` its stream stops after that many tokens until it is closed (`closed` is set then); with
    `gate` every request waits until the event is set (`waiting` counts those that arrived)."""

    def __init__(self, engine_id: str = "kv", *, records_kv: bool = True, hold: int | None = None, gate: threading.Event | None = None):
        self.engine_id, self.records_kv, self.hold, self.gate = engine_id, records_kv, hold, gate
        self.sessions: list[str | None] = []
        self.waiting = 0
        self.closed = threading.Event()

    async def generate(self, prompt_token_ids, sampling, session_id=None) -> GenerationResult:
        self.sessions.append(session_id)
        if self.gate is not None:
            self.waiting += 1
            while not self.gate.is_set():
                await asyncio.sleep(0.005)
        ids = KV_REPLY[: sampling.max_tokens]
        logprobs = [-0.125 * (i + 1) for i in range(len(ids))]
        kv_versions = KV_VERSIONS[: len(ids)] if self.records_kv else None
        versions = [SAMPLED_BY] * len(ids)
        return GenerationResult(
            "kv", list(prompt_token_ids), ids, logprobs, versions, "stop", engine_id=self.engine_id, kv_versions=kv_versions
        )

    async def stream(self, prompt_token_ids, sampling, session_id=None):
        try:
            result = await self.generate(prompt_token_ids, sampling, session_id)
            for i, token in enumerate(result.token_ids):
                if i == self.hold:
                    await asyncio.Event().wait()
                kv_versions = None if result.kv_versions is None else [result.kv_versions[i]]
                yield TokenDelta([token], [result.logprobs[i]], [SAMPLED_BY], kv_versions=kv_versions)
                await asyncio.sleep(0)
            yield result
        finally:
            self.closed.set()

    def health(self) -> dict:
        return {"alive": True, "engine_id": self.engine_id}
