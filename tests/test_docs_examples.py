"""The walkthrough's example (docs/REPLAY.md, docs/examples/): its config resolves, its environment loads
through the same import-path loader a run uses, and it really is not deterministic. The example agents
(docs/AGENTS.md) each run one episode through a real gateway and engine, and their turns are recorded."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncrl.configs.loader import load_config
from asyncrl.envs.registry import load_environment

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield
    sys.modules.pop("noisy_reasoning", None)


class RecordingClient:
    """Answers every chat call with "0" and keeps the prompts it was sent."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, *, messages, **_):
        self.prompts.append(messages[-1]["content"])
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="0"))])


def test_the_replay_demo_config_resolves_with_its_noisy_task(on_path):
    config = load_config(str(EXAMPLES / "replay_demo.yaml"), ["policy.path=/nonexistent"])
    assert set(config.tasks.mix) == {"reasoning", "noisy"} and config.learner.checkpoint_every == 5
    assert config.loop.record_batches  # replay train and --step need the batch records


def test_the_noisy_environment_gives_one_task_two_prompts(on_path):
    env = load_environment("noisy_reasoning:NoisyReasoning")
    task = env.sample_task(random.Random(7), "train")
    client = RecordingClient()
    for _ in range(40):
        asyncio.run(env.run_episode(task, client))
    assert set(client.prompts) == {task.prompt, "Please: " + task.prompt}


@pytest.fixture
def agent_gateway(tmp_path, monkeypatch):
    from agent_policy import agent_service
    from gateway_helpers import LiveGateway

    monkeypatch.syspath_prepend(str(EXAMPLES))
    service, engine = agent_service(tmp_path / "store")
    with LiveGateway(service) as live:
        yield live
    engine.shutdown()


def _recorded(gateway, answer: dict, *texts: str) -> list:
    """The episode's turns, after checking it finished and its first prompt holds `texts`."""
    info = answer["rollout"]
    assert info["status"] == "ok" and info["reward"] in (0.0, 1.0)
    turns = gateway.service.store.get(info["rollout_id"]).turns
    assert len(turns) == info["turns"] >= 1
    prompt = gateway.service.tokenizer.decode(turns[0].prompt_token_ids)
    assert all(text in prompt for text in texts), prompt
    assert all(t.logprobs and set(t.versions) == {0} for t in turns)
    return turns


def test_the_openai_agents_example_runs_a_recorded_episode(agent_gateway):
    import agent_openai_agents

    answer = asyncio.run(agent_openai_agents.episode(agent_gateway.url, agent_gateway.run_token))
    _recorded(agent_gateway, answer, "What is the capital of France?", '"name": "lookup_capital"', "Use lookup_capital.")


def test_the_anthropic_example_runs_a_recorded_two_turn_episode(agent_gateway):
    import agent_anthropic

    answer = agent_anthropic.episode(agent_gateway.url, agent_gateway.run_token)
    turns = _recorded(agent_gateway, answer, "What is the capital of Japan?", '"name": "lookup_capital"', agent_anthropic.SYSTEM)
    first, second = turns
    sampled = first.prompt_token_ids + first.completion_token_ids
    assert second.branch == first.branch and second.prompt_token_ids[: len(sampled)] == sampled  # the second call extends the first
