"""Benchmark: many concurrent agentic episodes through the gateway, and sandbox start-up per backend.

Episodes (1,000 at once by default) are the built-in agentic environment (envs/agentic.py) played by
the runner `asyncrl run` uses (`run_recorded_episode`, its in-process lifecycle, its episodes' HTTP
client: into the app without a socket, or with `loop.episode_transport=http` aiohttp's pool over
loopback) against a real TITO gateway served by uvicorn on this process's event loop (uvloop where
installed), as `asyncrl run` serves it, over a real SQLite trajectory store. What is not real, and why:

- the engines are `StubEngine`s (asyncrl/bench/gateway.py): each model call takes
  `engine_latency_s` of asyncio sleep and answers the `python` tool call first, the final answer
  after. A real tiny engine on 2 shared cores would put its own compute (and whoever else loads
  the machine) into every number; this measures how many episodes the loop, gateway and store carry.
- the sandbox is a stub whose `python` call sleeps a tool latency drawn from
  `LatencyDistribution` (envs/latency.py: lognormal body, Pareto tail, seeded) and prints 4, so
  each episode waits its tool mid-episode, with its rollout open at the gateway, as a real one does.

Measured:

- episodes_in_flight_max: most rollouts open at the gateway at once (opened, not yet finished);
- episodes_per_s: episodes started / wall time from the first start to the last end;
- episode_p50_s, episode_p99_s: each episode's wall time, from its start (before its rollout
  opens) to its return (after the rollout is finished);
- lost_episodes: episodes started minus rollouts the store holds in a terminal status (an episode
  that ended without its record, or whose rollout never opened, is lost);
- sandbox_start_ms_<backend>: `envs/sandbox/bench.py`'s mean time from `open()` to the answer of a
  first `print(1)`, closing included; null, with the reason in `sandbox_start_errors`, where the
  backend cannot run here (no Docker engine, no bubblewrap).

    asyncrl bench agentic --json bench-agentic.json
    DOCKER_HOST=unix:///run/asyncrl-docker/docker.sock asyncrl bench agentic bench.episodes=200 --json out.json
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import platform
import random
import secrets
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from asyncrl.configs.schema import RunConfig, Section
from asyncrl.envs.latency import LatencyConfig, LatencyDistribution
from asyncrl.envs.sandbox import ToolResult
from asyncrl.gateway.replica_actors import replica_name
from asyncrl.gateway.spread import SpreadLifecycle

from .stub_replica import stub_replica

PRESET = "agentic"
TOOL_CALL = "<tool_call>python<arg_key>code</arg_key><arg_value>print(2+2)</arg_value></tool_call><|endoftext|>"
ANSWER = "4<|endoftext|>"
ENGINES = 2
"""Stub engines per gateway."""
STORE_NAMESPACE = "bench-agentic"


class AgenticBenchOptions(Section):
    """Settings of `asyncrl bench agentic` itself (`bench.KEY=VALUE` on the command line)."""

    episodes: int = Field(1000, ge=1, le=100_000)
    """Episodes started at once."""
    engine_latency_s: float = Field(0.1, ge=0.0, le=60.0)
    """Time each model call takes at the stub engines."""
    latency: LatencyConfig = LatencyConfig()
    """The simulated latency of each tool call (envs/latency.py's distribution; `when` does not
    apply: the wait is the tool call itself, between the episode's two model calls)."""
    sandbox_runs: int = Field(5, ge=1, le=1000)
    """Timed sandbox starts per backend (after one untimed)."""
    sandbox_backends: list[Literal["docker", "process"]] = Field(["docker", "process"])
    """Backends whose start-up is measured."""


class ToolUsingEngine:
    """Two `StubEngine`s behind one handle: the tool call to a prompt without a tool result, the answer
    to one with. Read from the prompt, not counted per rollout: the gateway may route a rollout's
    calls to different engines."""

    def __init__(self, engine_id: str, tokenizer, latency_s: float) -> None:
        from asyncrl.policy.tokenizer import TOOL_RESPONSE_OPEN

        from .gateway import StubEngine

        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        self.engine_id = engine_id
        self.tool_call = StubEngine(engine_id, encode(TOOL_CALL), latency_s)
        self.answer = StubEngine(engine_id, encode(ANSWER), latency_s)
        self.tool_response = tokenizer.convert_tokens_to_ids(TOOL_RESPONSE_OPEN)

    async def generate(self, prompt_token_ids, sampling, session_id):
        stub = self.answer if self.tool_response in prompt_token_ids else self.tool_call
        return await stub.generate(prompt_token_ids, sampling, session_id)

    async def health(self) -> dict:
        return {"alive": True}


class SleepingSandboxes:
    """A sandbox backend whose `python` sleeps a drawn tool latency, then prints what print(2+2) does."""

    name = "sleeping"

    def __init__(self, latency: LatencyConfig) -> None:
        self.latency = LatencyDistribution(latency)
        self.calls = self.running = self.running_max = 0

    async def open(self) -> SleepingSandbox:
        return SleepingSandbox(self)


class SleepingSandbox:
    def __init__(self, backend: SleepingSandboxes) -> None:
        self.backend = backend

    async def run_python(self, code: str, *, timeout_s: float | None = None) -> ToolResult:
        backend = self.backend
        backend.calls += 1
        backend.running += 1
        backend.running_max = max(backend.running_max, backend.running)
        try:
            await asyncio.sleep(backend.latency.sample())
        finally:
            backend.running -= 1
        return ToolResult("4\n", "", 0)

    async def close(self) -> None:
        pass


class CountingLifecycle:
    """The in-process lifecycle, counting rollouts open at the gateway at once."""

    def __init__(self, lifecycle) -> None:
        self.lifecycle = lifecycle
        self.open = self.open_max = 0

    async def open_rollout(self, *args, **kwargs):
        rollout = await self.lifecycle.open_rollout(*args, **kwargs)
        self.open += 1
        self.open_max = max(self.open_max, self.open)
        return rollout

    async def finish(self, *args, **kwargs):
        try:
            return await self.lifecycle.finish(*args, **kwargs)
        finally:
            self.open -= 1

    async def abort(self, *args, **kwargs):
        try:
            return await self.lifecycle.abort(*args, **kwargs)
        finally:
            self.open -= 1


def run(config: RunConfig, json_path: str | None = None, options: AgenticBenchOptions | None = None) -> dict:
    from asyncrl.gateway.app import run_loop

    options = options or AgenticBenchOptions()
    with tempfile.TemporaryDirectory(prefix="bench-agentic-") as tmp:
        results = run_loop(episodes_at_once(config, options, str(Path(tmp) / "trajectories.db")))
    results.update(run_loop(_sandbox_starts(config, options)))
    results["setup"] = {
        "episodes": options.episodes, "engines": f"{ENGINES} StubEngine (asyncio.sleep {options.engine_latency_s} s a call)",
        "environment": "agentic (envs/agentic.py): tool call, tool result, answer", "tool": "stub sandbox sleeping a drawn latency",
        "latency": options.latency.model_dump(), "gateway": "in-process uvicorn, as asyncrl run", "store": "sqlite",
        "episode_timeout_s": config.loop.episode_timeout_s, "sandbox_runs": options.sandbox_runs,
        "machine": platform.machine(), "python": platform.python_version(),
    }  # fmt: skip
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
    return results


async def episodes_at_once(config: RunConfig, options: AgenticBenchOptions, store_path: str, *, replicas: int = 1) -> dict:
    """`replicas` > 1: gateway replicas g1... in processes of their own (`stub_replica`) beside this one's g0,
    the rollouts opened on each in turn (`asyncrl run`'s `SpreadLifecycle`), each episode calling its rollout's."""
    from asyncrl.configs.context import EnvContext
    from asyncrl.envs.agentic import AgenticEnv
    from asyncrl.gateway.serving import episode_http_client
    from asyncrl.gateway.store import open_store

    env = AgenticEnv.from_config(EnvContext.of(config))
    sandboxes = SleepingSandboxes(options.latency)
    rng = random.Random(config.seed)
    tasks = [env.sample_task(rng) for _ in range(options.episodes)]
    store = open_store(store_path, namespace=STORE_NAMESPACE)
    # One pooled connection per episode, as `asyncrl run` sizes it to loop.max_inflight.
    http_config = config.model_copy(update={
        "loop": config.loop.model_copy(update={"max_inflight": options.episodes}),
        "gateway": config.gateway.model_copy(update={"replicas": replicas}),
    })  # fmt: skip
    secret = secrets.token_bytes(32)
    processes = contextlib.ExitStack()
    try:
        others = [
            processes.enter_context(stub_replica(config, store_path, secret, replica_name(i), options.engine_latency_s))
            for i in range(1, replicas)
        ]
        own_gateway = _stub_gateway(config, store, options.engine_latency_s, replica_name(0) if others else None, secret)
        async with own_gateway as own, episode_http_client(http_config, own) as http:
            token = own.service.credentials.run_token
            urls = {replica.id: replica.url for replica in others}
            own_replicas = own.service.replicas
            lifecycle = SpreadLifecycle(own, own_replicas, urls, token, options.episodes) if others and own_replicas else own
            played = await _play(env, tasks, lifecycle, others, http, sandboxes, config.loop.episode_timeout_s)
            if isinstance(lifecycle, SpreadLifecycle):
                await lifecycle.aclose()
        counts = store.counts()
        recorded_calls = sum((t.metrics or {}).get("tool_calls", 0) for t in store.list())
    finally:
        processes.close()
        store.close()
    return _results(options, played, sandboxes, counts, recorded_calls)


@dataclass
class _Played:
    """What playing every episode at once measured at the client."""

    outcomes: list[str | BaseException]
    """Each episode's status, or the exception its runner raised."""
    walls: list[float]
    """The wall time of each episode that returned."""
    wall_s: float
    in_flight_max: int
    opened: dict[str, int]
    """Rollouts opened per gateway replica."""
    others_cpu_s: float
    """CPU seconds of the other replicas' processes meanwhile."""


async def _play(env, tasks: list, lifecycle, others: list, http, sandboxes: SleepingSandboxes, timeout_s: float) -> _Played:
    """Every task's episode at once, through `lifecycle` (a `SpreadLifecycle` over `others` or this process's gateway)."""
    from asyncrl.envs.runner import run_recorded_episode
    from asyncrl.gateway.app import settle_heap

    counting = CountingLifecycle(lifecycle)
    others_cpu = sum(r.cpu_s() for r in others)
    walls: list[float] = []

    async def episode(task) -> str:
        began = time.perf_counter()
        _, result = await run_recorded_episode(env, task, counting, timeout_s=timeout_s, http_client=http, sandboxes=sandboxes)
        walls.append(time.perf_counter() - began)
        return result.status

    settle_heap()
    began = time.perf_counter()
    outcomes = await asyncio.gather(*(episode(task) for task in tasks), return_exceptions=True)
    wall = time.perf_counter() - began
    others_cpu = sum(r.cpu_s() for r in others) - others_cpu
    opened = dict(lifecycle.opened) if isinstance(lifecycle, SpreadLifecycle) else {"g0": len(tasks)}
    return _Played(outcomes, walls, wall, counting.open_max, opened, others_cpu)


def _results(
    options: AgenticBenchOptions, played: _Played, sandboxes: SleepingSandboxes, counts: dict[str, int], recorded_calls: int
) -> dict:
    """The figures of the module docstring, from what the client measured, the sandboxes counted and the store holds."""
    from asyncrl.records import TERMINAL_STATUSES

    outcomes, walls = played.outcomes, played.walls
    failures = [repr(o) for o in outcomes if isinstance(o, BaseException)]
    recorded = sum(counts[status] for status in TERMINAL_STATUSES)
    return {
        "episodes_in_flight_max": played.in_flight_max,
        "episodes_per_s": round(options.episodes / played.wall_s, 2),
        "episode_p50_s": round(statistics.median(walls), 3) if walls else None,
        "episode_p99_s": round(_p99(walls), 3) if walls else None,
        "lost_episodes": options.episodes - recorded,
        "episodes_started": options.episodes,
        "episodes_recorded": recorded,
        "store_statuses": {status: counts[status] for status in ("running", *TERMINAL_STATUSES) if counts[status]},
        "episode_statuses": dict(Counter(o for o in outcomes if isinstance(o, str))),
        "runner_failures": len(failures), "first_runner_failures": failures[:3],
        "tool_calls": sandboxes.calls, "tool_calls_recorded": recorded_calls,
        "tools_in_flight_max": sandboxes.running_max,
        "wall_s": round(played.wall_s, 3),
        "opened_per_replica": played.opened, "other_replicas_cpu_s": round(played.others_cpu_s, 3),
    }  # fmt: skip


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else values[0]


async def _sandbox_starts(config: RunConfig, options: AgenticBenchOptions) -> dict:
    from asyncrl.envs.sandbox.bench import sandbox_start_ms

    results: dict = {}
    errors: dict = {}
    for backend in options.sandbox_backends:
        try:
            (ms,) = (await sandbox_start_ms(config.sandbox, (backend,), options.sandbox_runs)).values()
            results[f"sandbox_start_ms_{backend}"] = round(ms, 1)
        except Exception as error:  # this backend cannot run here: say why rather than report a number
            results[f"sandbox_start_ms_{backend}"] = None
            errors[backend] = f"{type(error).__name__}: {error}"
    results["sandbox_start_errors"] = errors
    return results


def _stub_gateway(config: RunConfig, store, engine_latency_s: float, replica_id: str | None = None, secret: bytes | None = None):
    """`asyncrl run`'s in-process gateway (uvicorn on this event loop), over stub engines instead of Ray workers."""
    from asyncrl.gateway.serving import InProcessGateway
    from asyncrl.policy.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    engines = [ToolUsingEngine(f"stub-{i}", tokenizer, engine_latency_s) for i in range(ENGINES)]
    return InProcessGateway(config, store, engines, tokenizer, model_name="bench-agentic", replica_id=replica_id, secret=secret)
