"""The walkthrough's example (docs/REPLAY.md, docs/examples/): its config resolves, its environment loads
through the same import-path loader a run uses, and it really is not deterministic."""

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
