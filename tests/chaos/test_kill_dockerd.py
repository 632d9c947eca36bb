"""Kill -9 the Docker engine under agentic episodes that run their tool code in Docker sandboxes.

The episodes are what a run's are (sched/episodes.py): `run_recorded_episode` tasks on one event
loop, through the real gateway (in-process, over loopback) in front of a real tiny engine, a SQLite
store and the `docker` sandbox backend, each episode in a container of its own. The engine is a
private dockerd beside the shared one (tests/chaos/services_helpers.py), killed at the moment every
episode of the first wave holds a live container, and restarted as an init system would.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from loop_helpers import run_config
from services_helpers import PrivateDockerd, record_figures

from asyncrl.configs.schema import DockerSandboxConfig
from asyncrl.envs.base import EpisodeResult
from asyncrl.envs.runner import run_recorded_episode
from asyncrl.envs.sandbox import open_backend
from asyncrl.gateway.serving import InProcessGateway, episode_http_client
from asyncrl.gateway.store import open_store
from asyncrl.policy.checkpoint import build_policy
from asyncrl.rollout.engine import EmbeddedEngine
from asyncrl.sched.clients import LocalWorkers

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


class ToolEpisodes:
    """One policy call, then the answer computed by tool code in the episode's sandbox. With `hold` set,
    each episode waits after its policy call until `hold` episodes hold a sandbox and `go` is set."""

    name = "sandbox-parity"
    needs_sandbox = True

    def __init__(self) -> None:
        self.hold, self.holding = 0, 0
        self.all_holding, self.go = asyncio.Event(), asyncio.Event()

    def sample_task(self, rng, split="train") -> int:
        return rng.randrange(1_000_000)

    async def run_episode(self, task: int, client, sandbox) -> EpisodeResult:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": str(task)}], max_tokens=4)
        if self.hold:
            self.holding += 1
            if self.holding == self.hold:
                self.all_holding.set()
            await self.go.wait()
        result = await sandbox.run_python(f"print({task} % 2)")
        assert result.ok, result
        return EpisodeResult(reward=float(result.stdout.strip() == str(task % 2)), metrics={"tool_done_at": time.monotonic()})


@pytest.fixture
def dockerd():
    engine = PrivateDockerd().start()
    try:
        engine.copy_sandbox_image()
        yield engine
    finally:
        engine.stop()


def test_episodes_whose_docker_engine_dies_crash_with_a_reason_and_later_ones_succeed(dockerd, tmp_path):
    config = run_config(tmp_path, "name=dockerd-chaos")
    sandbox = DockerSandboxConfig(docker_host=dockerd.host, cpus=0.5, memory_mb=64, start_timeout_s=30.0)
    env, figures = ToolEpisodes(), {}

    async def episodes() -> dict[str, list]:
        store = open_store(tmp_path / "trajectories.db")
        model, tokenizer, _ = build_policy(config.policy, config.seed)
        engines = LocalWorkers([EmbeddedEngine(model, config.rollout, engine_id="local-0")]).engines
        backend = open_backend(sandbox)
        waves: dict[str, list] = {}
        try:
            async with InProcessGateway(config, store, engines, tokenizer) as gateway, episode_http_client(config) as http:

                def wave(n: int) -> asyncio.Future:
                    return asyncio.gather(*(
                        run_recorded_episode(env, task, gateway, http_client=http, sandboxes=backend, timeout_s=120.0)
                        for task in range(n)
                    ))  # fmt: skip

                waves["before"] = [result for _, result in await wave(2)]
                env.hold = 6
                holding = asyncio.ensure_future(wave(env.hold))
                await env.all_holding.wait()  # the moment: six episodes, each with a live container
                killed = time.monotonic()
                await asyncio.to_thread(dockerd.kill)
                env.go.set()
                waves["killed"] = [result for _, result in await holding]
                env.hold = 0
                waves["down"] = [result for _, result in await wave(3)]  # no engine to start a container on
                starting = time.monotonic()
                await asyncio.to_thread(dockerd.start)
                restarted = time.monotonic()
                waves["after"] = [result for _, result in await wave(6)]
                first_tool_done = min(r.metrics.get("tool_done_at", float("inf")) for r in waves["after"])
                figures.update(
                    dockerd_down_s=round(restarted - killed, 2), dockerd_start_s=round(restarted - starting, 2),
                    restart_to_first_tool_call_s=round(first_tool_done - restarted, 2),
                    kill_to_first_tool_call_s=round(first_tool_done - killed, 2),
                )  # fmt: skip
                waves["counts"] = [store.counts()]
        finally:
            await backend.close()
            store.close()
        return waves

    waves = asyncio.run(episodes())
    assert [r.status for r in waves["before"]] == ["ok"] * 2
    for result in waves["killed"] + waves["down"]:  # each marked, with the sandbox's failure as the reason
        assert result.status == "env_crash" and result.reason.startswith("SandboxError") and dockerd.host in result.reason, result
    assert [r.status for r in waves["after"]] == ["ok"] * 6  # the same backend, on the restarted engine
    counts = waves["counts"][0]
    assert counts["running"] == 0 and counts["ok"] == 8 and counts["env_crash"] == 9  # every episode in one recorded status
    assert dockerd.containers() == []  # the backend removed its containers, the killed wave's too
    record_figures("kill_dockerd", {**figures, "episodes": 17, "crashed": 9, "lost": 0})
