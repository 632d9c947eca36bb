"""The task mix: shares by ratio, per-task rate limits, loading through the registry, and episodes as
asyncio tasks — 1,000 in flight at once through a live gateway, every one recorded under its task."""

from __future__ import annotations

import asyncio

import pytest
from gateway_helpers import LiveGateway, make_engine, make_service, scripted_model

from asyncrl.configs import load_config
from asyncrl.configs.schema import SamplingConfig
from asyncrl.envs.agentic import AgenticEnv
from asyncrl.envs.base import EpisodeResult
from asyncrl.envs.reasoning import ReasoningEnv
from asyncrl.envs.runner import run_recorded_episode
from asyncrl.gateway.client import AsyncGatewayClient
from asyncrl.gateway.store import open_store
from asyncrl.policy.tokenizer import ASSISTANT, EOS
from asyncrl.sched.tasks import Task, TaskMix


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def names(mix: TaskMix, n: int) -> list[str | None]:
    return [task.name if task else None for task in (mix.pick() for _ in range(n))]


def test_groups_follow_the_ratios_smoothly():
    mix = TaskMix([Task("a", None, ratio=3), Task("b", None, ratio=1), Task("c", None, ratio=0.5)], group_size=8)
    picked = names(mix, 90)
    assert [picked.count(n) for n in "abc"] == [60, 20, 10]
    for end in range(1, 91):  # every prefix within one group of its share
        for name, share in (("a", 3 / 4.5), ("b", 1 / 4.5), ("c", 0.5 / 4.5)):
            assert abs(picked[:end].count(name) - share * end) <= 1


def test_a_rate_limited_task_starts_at_most_its_rate_and_never_bursts():
    clock = Clock()
    limited = Task("slow", None, ratio=100, max_episodes_per_s=4.0)  # groups of 8: one every 2 s
    mix = TaskMix([limited, Task("fast", None, ratio=1)], group_size=8, clock=clock)
    assert names(mix, 3) == ["slow", "fast", "fast"]  # one group at once, then the others fill in
    clock.now = 1.0
    assert names(mix, 1) == ["fast"]
    clock.now = 2.0
    assert names(mix, 2) == ["slow", "fast"]
    clock.now = 100.0  # a long idle spell earns one group, not fifty
    assert names(mix, 3) == ["slow", "fast", "fast"]
    alone = TaskMix([Task("slow", None, max_episodes_per_s=4.0)], group_size=8, clock=clock)
    assert names(alone, 2) == ["slow", None]  # None: nothing may start now


def test_the_mix_loads_each_task_through_the_registry(tmp_path):
    config = load_config("quickstart", [
        "tasks.mix={math: {env: reasoning, ratio: 2, eval_problems: 0},"
        " tools: {env: agentic, max_episodes_per_s: 3, options: {max_turns: 2}}}",
    ])  # fmt: skip
    mix = TaskMix.from_config(config)
    math, tools = mix.tasks
    assert (math.name, type(math.env), math.ratio, math.sandboxes) == ("math", ReasoningEnv, 2, None)
    assert (tools.name, type(tools.env), tools.max_episodes_per_s) == ("tools", AgenticEnv, 3)
    assert tools.env.config.max_turns == 2 and tools.sandboxes.name == "process"
    assert [(t.name, n) for t, n in mix.evaluated(50)] == [("tools", 50)]
    default = TaskMix.from_config(load_config("quickstart"))
    assert [(t.name, type(t.env)) for t in default.tasks] == [("reasoning", ReasoningEnv)]


class Waiting:
    """Every episode waits until all of them have started, then calls the policy once."""

    name = "waiting"

    def __init__(self, total: int) -> None:
        self.total, self.running, self.peak = total, 0, 0
        self.all_started = asyncio.Event()

    def sample_task(self, rng, split="train"):
        return 0

    async def run_episode(self, task, client) -> EpisodeResult:
        self.running += 1
        self.peak = max(self.peak, self.running)
        if self.running == self.total:
            self.all_started.set()
        await self.all_started.wait()  # no deadline of its own: on a busy machine 1,000 opens take minutes
        reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "?"}], max_tokens=2)
        self.running -= 1
        return EpisodeResult(float(reply.choices[0].message.content == "7"))


@pytest.mark.slow
def test_a_thousand_episodes_in_flight_as_asyncio_tasks(tmp_path):
    import httpx

    total = 1000
    engine = make_engine("e0", scripted_model([ASSISTANT, "7", EOS]))
    store = open_store(tmp_path)
    greedy = SamplingConfig(temperature=0.0, max_tokens=16)  # 2,000 sampled tokens would stray from the script now and then

    async def go(url: str, token: str):
        env = Waiting(total)
        gateway = AsyncGatewayClient(url, token=token, timeout=None)  # 1,000 opens queue for the pool on a busy machine
        async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=16)) as http:
            results = await asyncio.gather(*(
                run_recorded_episode(env, 0, gateway, group_id=f"g{i // 8}", task_name="wait", http_client=http, timeout_s=900)
                for i in range(total)
            ))  # fmt: skip
        await gateway.aclose()
        return env.peak, results

    try:
        with LiveGateway(make_service(store, [engine], sampling=greedy)) as live:
            peak, results = asyncio.run(go(live.url, live.run_token))
        assert peak == total
        assert [(r.status, r.reward, r.reason) for _, r in results if (r.status, r.reward) != ("ok", 1.0)] == []
        counts = store.counts()
        assert counts["ok"] == total and counts["running"] == 0
        assert {t.task for t in store.list(status="ok")} == {"wait"}
    finally:
        engine.shutdown()


def test_a_sandbox_backend_that_cannot_start_stops_the_run_before_it_starts(tmp_path, capsys):
    """Not every episode's env_crash for the whole wall budget: one clear error before Ray starts."""
    pytest.importorskip("docker")
    from asyncrl.cli import main
    from asyncrl.envs.sandbox.base import SandboxError

    dead = ["sandbox.backend=docker", f"sandbox.docker_host=unix://{tmp_path}/no-engine.sock", "sandbox.start_timeout_s=5"]
    with pytest.raises(SandboxError, match="no Docker engine answers"):
        asyncio.run(TaskMix.from_config(load_config("agentic", dead)).check_sandboxes())
    assert asyncio.run(TaskMix.from_config(load_config("quickstart")).check_sandboxes()) is None  # nothing sandboxed
    from families import save_family_checkpoint

    checkpoint = save_family_checkpoint("llama", tmp_path / "checkpoint")  # a policy that passes its own start-up check
    args = ["run", "agentic", *dead, f"runs_dir={tmp_path}", f"policy.path={checkpoint}", "logging.wandb=disabled"]
    assert main(args) == 2
    assert "no Docker engine answers" in capsys.readouterr().err
