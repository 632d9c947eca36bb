"""`env: verifiers`: environments of the verifiers library (single-turn, multi-turn, tools; defined in
tests/verifiers_envs.py as a verifiers user writes them) run their own rollouts through the real TITO
gateway, their rubric gives the reward, the recorded turns train the learner, and what asyncrl cannot
run (group rubrics, missing splits, bad options) is refused at start-up naming the problem."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import pytest
from gateway_helpers import ScriptedEngine
from loop_helpers import run_config, run_in_process, started

from asyncrl.configs.context import EnvContext
from asyncrl.configs.schema import RunConfig
from asyncrl.envs.registry import load_environment
from asyncrl.envs.runner import run_recorded_episode
from asyncrl.gateway.serving import evaluation_gateway
from asyncrl.gateway.store import open_store
from asyncrl.policy.tokenizer import (
    ARG_KEY_CLOSE,
    ARG_KEY_OPEN,
    ARG_VALUE_CLOSE,
    ARG_VALUE_OPEN,
    EOS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    build_tokenizer,
)

pytest.importorskip("verifiers")

from asyncrl.envs.verifiers_env import VerifiersError

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
TOKENIZER = build_tokenizer()


def env_of(factory: str, **options):
    return load_environment("verifiers", {"environment": f"verifiers_envs:{factory}", **options}, EnvContext())


def episode(env, task, replies: list[str], config: RunConfig | None = None):
    """(result, the prompts the engine was sent, decoded): one recorded episode through the real gateway."""
    remaining = list(replies)
    engine = ScriptedEngine(lambda _prompt: remaining.pop(0))

    async def go():
        async with evaluation_gateway(config or RunConfig(), [engine], TOKENIZER) as gateway:
            return (await run_recorded_episode(env, task, gateway, sandboxes=None, evaluation=True))[1]

    result = asyncio.run(go())
    return result, [TOKENIZER.decode(prompt) for prompt, _ in engine.requests]


def tool_call(name: str, **arguments: str) -> str:
    args = "".join(f"{ARG_KEY_OPEN}{k}{ARG_KEY_CLOSE}{ARG_VALUE_OPEN}{v}{ARG_VALUE_CLOSE}" for k, v in arguments.items())
    return f"{TOOL_CALL_OPEN}{name}{args}{TOOL_CALL_CLOSE}{EOS}"


def test_a_single_turn_environment_is_scored_by_its_rubric():
    env = env_of("load_single_turn")
    task = env.sample_task(random.Random(0))
    right, prompts = episode(env, task, [task["answer"] + EOS])
    assert (right.status, right.reward, right.metrics["exact_answer"]) == ("ok", 1.0, 1.0)
    # The environment's own formatting reached the policy: its system prompt, then the question.
    assert prompts == [f"<|system|>Add the numbers.<|user|>{task['question']}<|assistant|>"]
    wrong, _ = episode(env, task, ["1" + task["answer"] + EOS])
    assert (wrong.status, wrong.reward, wrong.metrics["exact_answer"], wrong.metrics["replied"]) == ("ok", 0.0, 0.0, 1.0)


def test_an_empty_reply_is_a_sample_worth_nothing_not_an_error(caplog):
    env = env_of("load_single_turn")
    result, prompts = episode(env, env.sample_task(random.Random(0)), [EOS])  # the policy ends its reply at once
    assert (result.status, result.reward, result.metrics["empty_reply"]) == ("ok", 0.0, True) and len(prompts) == 1
    assert not [r for r in caplog.records if "EmptyModelResponseError" in r.getMessage()]  # not logged as an aborted rollout


def test_a_multi_turn_environment_sees_each_reply_and_answers_it():
    env = env_of("load_multi_turn", environment_args={"max_turns": 4})
    task = next(t for t in (env.sample_task(random.Random(s)) for s in range(50)) if t["answer"] not in ("0", "9"))
    result, prompts = episode(env, task, ["0" + EOS, "9" + EOS, task["answer"] + EOS])
    assert (result.status, result.reward, result.metrics["num_turns"], result.metrics["stop_condition"]) == ("ok", 1.0, 3.0, "solved")
    assert prompts[1].endswith("<|assistant|>0<|endoftext|><|user|>higher<|assistant|>")
    assert prompts[2].endswith("<|assistant|>9<|endoftext|><|user|>lower<|assistant|>")
    unsolved, _ = episode(env, task, ["0" + EOS] * 4)
    assert (unsolved.reward, unsolved.metrics["num_turns"], unsolved.metrics["stop_condition"]) == (0.0, 4.0, "max_turns_reached")


def test_a_tool_environment_gets_the_parsed_call_and_its_result_goes_back_to_the_policy():
    env = env_of("load_tool_env", max_tokens=64)
    task = env.sample_task(random.Random(1))
    a, b = task["question"].split("+")
    result, prompts = episode(env, task, [tool_call("add", a=a, b=b), task["answer"] + EOS])
    assert (result.status, result.reward, result.metrics["add_calls"], result.metrics["total_tool_calls"]) == ("ok", 1.0, 1.0, 1.0)
    assert prompts[0].startswith("<|system|>tools: add<|user|>")  # the tool schema came from the environment's tools
    assert prompts[1].endswith(f"<|observation|><tool_response>{task['answer']}</tool_response><|assistant|>")


def test_a_crashing_environment_marks_its_episode_and_nothing_else():
    env = env_of("load_broken")
    result, _ = episode(env, env.sample_task(random.Random(0)), ["x" + EOS, "y" + EOS])
    assert result.status == "env_crash" and result.reward == 0.0 and "the environment's own bug" in result.reason


def test_a_prompt_longer_than_the_policy_takes_is_the_policys_error_not_a_crash():
    env = env_of("load_single_turn")
    task = env.sample_task(random.Random(0))
    task["prompt"] = [{"role": "user", "content": "9+" * 200}]
    result, prompts = episode(env, task, [], RunConfig(gateway={"max_prompt_tokens": 256}))  # refused by the gateway
    assert prompts == [] and result.status == "error" and result.reward == 0.0


def test_the_held_out_split_is_the_eval_dataset_or_a_disjoint_prompt_hash():
    own = env_of("load_single_turn", environment_args={"rows": 30, "eval_rows": 10})
    assert len(own.train_rows) == 30 and len(own.eval_rows) == 10
    assert {r["question"] for r in own.eval_rows}.isdisjoint(r["question"] for r in own.train_rows)
    hashed = env_of("load_single_turn", environment_args={"rows": 200}, heldout_fraction=0.25)
    train, held = {r["question"] for r in hashed.train_rows}, {r["question"] for r in hashed.eval_rows}
    assert train.isdisjoint(held) and len(train) + len(held) == 200 and 20 < len(held) < 80
    assert {
        r["question"] for r in env_of("load_single_turn", environment_args={"rows": 200}, heldout_fraction=0.25).eval_rows
    } == held  # stable
    rng = random.Random(3)
    assert all(hashed.sample_task(rng, "eval")["question"] in held for _ in range(50))
    assert all(hashed.sample_task(rng, "train")["question"] in train for _ in range(50))
    fixed = hashed.heldout_tasks(20, seed=5)
    assert len({t["question"] for t in fixed}) == 20 and fixed == hashed.heldout_tasks(20, seed=5)
    with pytest.raises(VerifiersError, match="lower the task's eval_problems"):
        own.heldout_tasks(11, seed=0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "environment: Field required"),
        ({"environment": "verifiers_envs:load_single_turn", "heldout_fractions": 0.1}, "heldout_fractions: Extra inputs"),
        ({"environment": "verifiers_envs:load_single_turn", "heldout_fraction": 1.0}, "heldout_fraction: Input should be less than 1"),
        ({"environment": "no_such_verifiers_env"}, "could not be loaded"),
        ({"environment": "verifiers_envs:no_such_factory"}, "has no attribute 'no_such_factory'"),
        ({"environment": "verifiers_envs:_sums", "environment_args": {"count": 3}}, "built a Dataset, not a verifiers Environment"),
        ({"environment": "verifiers_envs:load_single_turn", "environment_args": {"rowz": 3}}, "with \\['rowz'\\]: .*rowz"),
        ({"environment": "verifiers_envs:load_group_rubric"}, "group-level reward functions"),
        ({"environment": "verifiers_envs:load_single_turn", "environment_args": {"rows": 2}}, "leaves the (held-out|training) split"),
    ],
)
def test_what_cannot_run_is_refused_at_start_up_naming_the_problem(options, message):
    with pytest.raises(VerifiersError, match=message):
        load_environment("verifiers", options, EnvContext())


def test_an_installed_environment_module_loads_by_its_id(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    try:
        env = load_environment("verifiers", {"environment": "verifiers_sums", "environment_args": {"train_rows": 50, "eval_rows": 20}})
        task = env.sample_task(random.Random(0))
        assert task["prompt"] == [{"role": "user", "content": task["question"]}] and len(env.eval_rows) == 20
        assert {r["question"] for r in env.eval_rows}.isdisjoint(r["question"] for r in env.train_rows)
        assert episode(env, task, [task["answer"] + EOS])[0].reward == 1.0
    finally:
        sys.modules.pop("verifiers_sums", None)


def test_the_verifiers_env_meets_the_environment_contract():
    from asyncrl.jobs.contract import check_environment

    report = check_environment(env_of("load_multi_turn"), episodes=3, eval_episodes=2)
    assert len(report.results) == 3 and all(r.status == "ok" for r in report.results)
    for trajectory, result in zip(report.trajectories, report.results, strict=True):
        # verifiers does not count a turn the policy ended at once (an empty reply); the gateway recorded it
        policy_calls = result.metrics["num_turns"] + bool(result.metrics.get("empty_reply"))
        assert trajectory.turns and len(trajectory.turns) == policy_calls


def test_a_verifiers_environment_trains_in_the_real_loop_with_balanced_books(tmp_path):
    environment_args = {"rows": 60, "eval_rows": 8, "reward": "odd_length"}  # a reward the random policy sometimes earns
    options = {"environment": "verifiers_envs:load_single_turn", "environment_args": environment_args}
    mix = f"tasks.mix={json.dumps({'sums': {'env': 'verifiers', 'options': options, 'eval_problems': 8}})}"
    config = run_config(tmp_path, "name=vf", "loop.steps=2", mix)
    result = asyncio.run(run_in_process(config, None))
    state, counts = result["state"], result["counts"]
    assert state.version == 2 and sum(state.ledger.values()) == started(counts) > 0 and state.ledger["trained"] > 0
    assert counts["acked"] == started(counts) and state.ledger.get("dropped_crash", 0) == 0
    store = open_store(result["rundir"].store_address(config), namespace=config.name)
    try:
        done = [t for t in store.list() if t.status == "ok"]
    finally:
        store.close()
    assert done and {t.task for t in done} == {"sums"}
    assert all(t.turns and t.reward == t.metrics.get("odd_length", 0.0) for t in done)  # the rubric's reward, on recorded turns
    assert {t.reward for t in done} == {0.0, 1.0}
    evals = [r for r in result["records"] if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]


def test_the_shipped_example_config_resolves_to_its_verifiers_task():
    from asyncrl.configs.loader import load_config

    config = load_config(str(EXAMPLES / "verifiers_example.yaml"), ["policy.path=/nonexistent"])
    task = config.tasks.mix["sums"]
    assert task.env == "verifiers" and task.options["environment"] == "verifiers_sums"
