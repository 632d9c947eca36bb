"""The agentic environment: it speaks exactly the tool-call format the SFT demonstrations teach,
rewards the verified product (a small format term otherwise), and keeps a fixed held-out split.
Episodes run through a real gateway (its chat template and tool-call parser) in evaluation rollouts,
in front of a scripted engine, with a real process sandbox (bubblewrap)."""

from __future__ import annotations

import asyncio
import random
import shutil

import pytest
from gateway_helpers import ScriptedEngine

from asyncrl.configs.schema import AgenticTaskConfig, ProcessSandboxConfig, RunConfig
from asyncrl.envs.agentic import AgenticEnv
from asyncrl.envs.runner import run_recorded_episode
from asyncrl.envs.sandbox import open_backend
from asyncrl.envs.tool_demos import PYTHON_TOOL, ToolProblem
from asyncrl.gateway.serving import evaluation_gateway
from asyncrl.learner.sft_data import render_demo
from asyncrl.policy.tokenizer import (
    ARG_KEY_CLOSE,
    ARG_KEY_OPEN,
    ARG_VALUE_CLOSE,
    ARG_VALUE_OPEN,
    EOS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    build_tokenizer,
)  # fmt: skip

TOKENIZER = build_tokenizer()
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="the process sandbox needs bubblewrap")


def call(name: str, code: str) -> str:
    return f"{TOOL_CALL_OPEN}{name}{ARG_KEY_OPEN}code{ARG_KEY_CLOSE}{ARG_VALUE_OPEN}{code}{ARG_VALUE_CLOSE}{TOOL_CALL_CLOSE}{EOS}"


def episode(problem: ToolProblem, replies: list[str], config: AgenticTaskConfig | None = None):
    """The episode's result, and the prompt tokens of each call the gateway sent the engine."""
    remaining = list(replies)
    engine = ScriptedEngine(lambda _prompt: remaining.pop(0))

    async def go():
        async with evaluation_gateway(RunConfig(), [engine], TOKENIZER) as gateway:
            _, result = await run_recorded_episode(
                AgenticEnv(config), problem, gateway, sandboxes=open_backend(ProcessSandboxConfig()), evaluation=True
            )
            return result

    return asyncio.run(go()), [prompt for prompt, _ in engine.requests]


@needs_bwrap
def test_an_episode_is_the_sft_demonstration_token_for_token():
    problem = ToolProblem(4821, 9182, template=1)
    demo = render_demo(TOKENIZER, problem.demonstration(), tools=[PYTHON_TOOL])
    # The demonstration's assistant spans, in order: what a perfectly trained policy writes.
    spans, start = [], None
    for i, trained in enumerate([*demo.loss_mask, 0]):
        if trained and start is None:
            start = i
        elif not trained and start is not None:
            spans.append((start, i))
            start = None
    replies = [TOKENIZER.decode(demo.token_ids[a:b]) for a, b in spans]
    result, prompts = episode(problem, replies)
    assert result.status == "ok" and result.reward == 1.0
    assert result.metrics == {"correct": True, "tool_calls": 1, "clean_runs": 1, "answered": True}
    # Each prompt the environment built is the demonstration up to that assistant span, exactly
    # (the tool's real output from the sandbox included).
    assert [p for p in prompts] == [demo.token_ids[:a] for a, _ in spans]


@needs_bwrap
@pytest.mark.parametrize(
    ("replies", "reward", "metrics"),
    [
        ([call("python", "print(6*7)"), f"41{EOS}"], 0.1, {"correct": False, "tool_calls": 1, "clean_runs": 1}),
        ([call("python", "print(6*)"), f"42{EOS}"], 1.0, {"correct": True, "tool_calls": 1, "clean_runs": 0}),
        ([call("python", "print(6*)"), f"41{EOS}"], 0.0, {"correct": False, "clean_runs": 0}),
        ([call("calculator", "6*7"), f"4{EOS}"], 0.0, {"tool_calls": 1, "clean_runs": 0}),
        ([f"42{EOS}"], 1.0, {"correct": True, "tool_calls": 0}),
        ([call("python", "print(1)")] * 3, 0.1, {"answered": False, "tool_calls": 3}),
    ],
)
def test_reward_is_the_verified_answer_plus_a_small_format_term(replies, reward, metrics):
    result, _ = episode(ToolProblem(6, 7), replies)
    assert result.status == "ok" and result.reward == pytest.approx(reward)
    assert metrics.items() <= result.metrics.items()


@needs_bwrap
def test_the_model_reads_tool_errors():
    _, prompts = episode(ToolProblem(6, 7), [call("python", "1/0"), f"0{EOS}"])
    seen = TOKENIZER.decode(prompts[1])
    assert "ZeroDivisionError" in seen and "[tool error: exit code 1]" in seen


def test_the_held_out_split_is_disjoint_and_fixed():
    env = AgenticEnv(AgenticTaskConfig(min_digits=2, max_digits=2, heldout_fraction=0.2))
    rng = random.Random(0)
    train = {(p.a, p.b) for p in (env.sample_task(rng) for _ in range(2000))}
    held = {(p.a, p.b) for p in (env.sample_task(rng, "eval") for _ in range(500))}
    assert train and held and not train & held
    assert env.sample_task(random.Random(5), "eval") == env.sample_task(random.Random(5), "eval")
