"""The reasoning environment, the episode runner and held-out evaluation against a live gateway and a real engine."""

from __future__ import annotations

import asyncio
import random

import pytest
from gateway_helpers import LiveGateway, make_engine, make_service, scripted_model

from asyncrl.configs.schema import ArithmeticTaskConfig
from asyncrl.envs.arithmetic import Problem
from asyncrl.envs.base import Environment, EpisodeResult
from asyncrl.envs.evaluation import evaluate_env
from asyncrl.envs.reasoning import ReasoningEnv
from asyncrl.envs.runner import run_recorded_episode
from asyncrl.gateway.client import AsyncGatewayClient
from asyncrl.gateway.store import open_store
from asyncrl.policy.tokenizer import ASSISTANT, EOS


@pytest.fixture(scope="module")
def engine():
    # A real model whose weights make it answer "7" to anything.
    engine = make_engine("e0", scripted_model([ASSISTANT, "7", EOS]))
    yield engine
    engine.shutdown()


@pytest.fixture
def gateway(engine, tmp_path):
    store = open_store(tmp_path)
    with LiveGateway(make_service(store, [engine])) as live:
        yield live, store


def _run(live, env, task, **options):
    async def go():
        client = AsyncGatewayClient(live.url, token=live.run_token)
        try:
            return await run_recorded_episode(env, task, client, group_id="g1", **options)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_reasoning_env_is_an_environment_and_splits_tasks():
    env = ReasoningEnv(ArithmeticTaskConfig())
    assert isinstance(env, Environment)
    rng = random.Random(0)
    train = {env.sample_task(rng).canonical for _ in range(200)}
    held = {env.sample_task(rng, "eval").canonical for _ in range(200)}
    assert not train & held


@pytest.mark.parametrize(("problem", "reward"), [(Problem(3, 4, "+"), 1.0), (Problem(2, 2, "+"), 0.0)])
def test_reward_is_the_verified_answer_and_the_rollout_is_recorded(gateway, problem, reward):
    live, store = gateway
    rollout_id, result = _run(live, ReasoningEnv(ArithmeticTaskConfig()), problem)
    assert result.status == "ok" and result.reward == reward
    trajectory = store.get(rollout_id)
    assert trajectory.status == "ok" and trajectory.reward == reward and trajectory.task == "reasoning"
    assert trajectory.group_id == "g1" and len(trajectory.turns) == 1
    assert trajectory.metrics["correct"] is (reward == 1.0)


class _Crashing:
    name = "crashing"

    def sample_task(self, rng, split="train"):
        return None

    async def run_episode(self, task, client):
        raise RuntimeError("sandbox engine gone")


class _Hanging(_Crashing):
    name = "hanging"

    async def run_episode(self, task, client):
        await asyncio.sleep(30)


class _Garbage(_Crashing):
    name = "garbage"

    async def run_episode(self, task, client):
        return {"reward": 1}


@pytest.mark.parametrize(
    ("env", "status", "reason"),
    [
        (_Crashing(), "env_crash", "sandbox engine gone"),
        (_Hanging(), "timeout", "exceeded"),
        (_Garbage(), "env_crash", "not EpisodeResult"),
    ],
)
def test_broken_environments_end_in_one_recorded_status(gateway, env, status, reason):
    live, store = gateway
    # Only the hanging environment may meet its time limit: the others end far inside the default one, however busy the machine.
    rollout_id, result = _run(live, env, None, **({"timeout_s": 0.5} if isinstance(env, _Hanging) else {}))
    assert isinstance(result, EpisodeResult) and result.status == status and reason in result.reason
    trajectory = store.get(rollout_id)
    assert trajectory.status == status and trajectory.reward == 0.0


def test_held_out_evaluation_goes_through_the_gateway_and_records_nothing(gateway):
    live, store = gateway
    env = ReasoningEnv(ArithmeticTaskConfig())

    async def go():
        async with AsyncGatewayClient(live.url, token=live.run_token) as client:
            return await evaluate_env(env, client, num_problems=40, seed=6)

    result = asyncio.run(go())
    # The engine answers 7 to anything: exactly the held-out problems whose answer is 7 are right.
    assert [p.answer for p in env.heldout_tasks(40, 6)].count(7) == 1
    assert (result.accuracy, result.num_problems, result.statuses) == (1 / 40, 40, {"ok": 40})
    assert store.list() == []
