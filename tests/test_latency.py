"""The heavy-tailed latency wrapper: seeded draws, a tail far beyond the median, and an episode whose
reward, status and model calls are the wrapped environment's own."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import pytest

from asyncrl.envs.base import EpisodeResult
from asyncrl.envs.latency import LatencyConfig, LatencyDistribution, LatencyEnv


def draws(n: int, **config) -> list[float]:
    distribution = LatencyDistribution(LatencyConfig(**config))
    return [distribution.sample() for _ in range(n)]


def test_draws_are_seeded():
    assert draws(50, seed=3) == draws(50, seed=3)
    assert draws(50, seed=3) != draws(50, seed=4)


def test_the_tail_is_heavy_and_capped():
    sample = sorted(draws(20_000, median_s=0.5, sigma=1.0, tail_prob=0.05, tail_min_s=2.0, tail_alpha=1.5, max_s=30.0))
    median, p99 = statistics.median(sample), sample[int(0.99 * len(sample))]
    assert median == pytest.approx(0.5, rel=0.1)  # the tail moves the median only a little
    assert p99 > 10 * median  # a light (e.g. normal) tail would put p99 within a few medians
    assert statistics.fmean(sample) > 1.5 * median  # the mean sits well above the median
    assert sample[-1] == 30.0 and min(sample) > 0  # capped, never negative


def test_no_spread_means_a_fixed_latency():
    assert draws(100, median_s=0.25, sigma=0.0, tail_prob=0.0) == pytest.approx([0.25] * 100)


class FixedEnv:
    name = "fixed"

    def __init__(self) -> None:
        self.calls = []

    def sample_task(self, rng: random.Random, split="train") -> int:
        return rng.randrange(100) + (1000 if split == "eval" else 0)

    async def run_episode(self, task: int, client) -> EpisodeResult:
        self.calls.append((task, client, time.perf_counter()))
        return EpisodeResult(reward=0.75, status="env_crash", metrics={"turns": 2}, reason="sandbox")


@pytest.mark.parametrize("when", ["before", "after"])
def test_the_wrapped_episode_is_unchanged_but_waits(when):
    inner = FixedEnv()
    env = LatencyEnv(inner, LatencyConfig(median_s=0.05, sigma=0.0, tail_prob=0.0, when=when))
    assert env.name == "fixed"
    assert env.sample_task(random.Random(1), "eval") == inner.sample_task(random.Random(1), "eval")

    start = time.perf_counter()
    result = asyncio.run(env.run_episode(7, "client"))
    end = time.perf_counter()
    assert (result.reward, result.status, result.reason) == (0.75, "env_crash", "sandbox")
    assert result.metrics == {"turns": 2, "tool_latency_s": pytest.approx(0.05)}
    task, client, called_at = inner.calls[0]
    assert (task, client) == (7, "client")
    # The wait falls on its side of the model call (lower bounds only: a sleep never ends early).
    assert (called_at - start if when == "before" else end - called_at) >= 0.05


def test_the_wait_does_not_block_the_event_loop():
    # Another task runs while the episode waits (a blocking sleep would not let it in first).
    inner = FixedEnv()
    env = LatencyEnv(inner, LatencyConfig(median_s=0.01, sigma=0.0, tail_prob=0.0, when="before"))
    ran = []

    async def other():
        ran.append(len(inner.calls))

    async def both():
        await asyncio.gather(env.run_episode(1, None), other())

    asyncio.run(both())
    assert ran == [0]  # the other task ran before the episode reached its model call


class ToolEnv(FixedEnv):
    name = "tool"
    needs_sandbox = True

    async def run_episode(self, task: int, client, sandbox) -> EpisodeResult:
        output = await sandbox.run_python("print(6 * 7)")
        return EpisodeResult(reward=1.0, metrics={"output": output})


class RecordingSandbox:
    def __init__(self) -> None:
        self.codes, self.closed = [], False

    async def run_python(self, code: str) -> str:
        self.codes.append(code)
        return "42"

    async def close(self) -> None:
        self.closed = True


class RecordingBackend:
    def __init__(self) -> None:
        self.opened: list[RecordingSandbox] = []

    async def open(self) -> RecordingSandbox:
        self.opened.append(RecordingSandbox())
        return self.opened[-1]


def test_a_wrapped_environment_that_needs_a_sandbox_gets_the_runners():
    from asyncrl.envs.base import needs_sandbox
    from asyncrl.envs.runner import play_episode

    env = LatencyEnv(ToolEnv(), LatencyConfig(median_s=0.01, sigma=0.0, tail_prob=0.0))
    assert needs_sandbox(env) and not needs_sandbox(LatencyEnv(FixedEnv(), LatencyConfig()))
    backend = RecordingBackend()
    result = asyncio.run(play_episode(env, 3, client=None, sandboxes=backend))
    assert (result.status, result.reward, result.metrics["output"]) == ("ok", 1.0, "42"), result
    (sandbox,) = backend.opened
    assert sandbox.codes == ["print(6 * 7)"] and sandbox.closed
