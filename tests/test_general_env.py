"""The built-in general task: its verifiers on hand-written answers, its splits, its held-out
evaluation through envs/evaluation.py, and its SFT demonstrations."""

from __future__ import annotations

import asyncio
import random

import pytest
from gateway_helpers import ScriptedEngine

from asyncrl.configs import load_config
from asyncrl.configs.context import EnvContext
from asyncrl.configs.schema import GeneralTaskConfig, RunConfig, SFTConfig
from asyncrl.envs.arithmetic import is_heldout
from asyncrl.envs.evaluation import evaluate_env
from asyncrl.envs.general import GeneralEnv, GeneralTask, Instruction
from asyncrl.envs.registry import load_environment
from asyncrl.gateway.serving import evaluation_gateway
from asyncrl.jobs.contract import check_environment
from asyncrl.jobs.sft import demo_stream
from asyncrl.policy.tokenizer import ASSISTANT, EOS, USER, build_tokenizer

FULL = Instruction(("cat", "sun"), "upper", count=3, banned="dog", ending="!")
TOKENIZER = build_tokenizer()


def test_the_prompt_and_demonstrated_answer():
    assert FULL.prompt == "Use cat sun. 3 words. Caps. No dog. End with !"
    assert FULL.answer == "CAT SUN CAT!"
    assert Instruction(("owl",), "title").prompt == "Use owl. Title case."
    assert Instruction(("owl", "red"), "lower", count=2).answer == "owl red"


@pytest.mark.parametrize(
    ("answer", "failed"),
    [
        ("CAT SUN CAT!", []),
        ("SUN CAT SUN!", []),  # any answer meeting the constraints, not only the demonstrated one
        ("  CAT SUN CAT!" + EOS, []),
        ("cat sun cat!", ["case"]),
        ("CAT SUN!", ["count"]),
        ("CAT SUN DOG!", ["banned"]),
        ("CAT SUN CAT", ["ending"]),
        ("CAT CAT CAT!", ["words"]),
        ("CAT, SUN, DOGS!", []),  # punctuation is not part of a word; "dogs" is not "dog"
        ("Cat Sun Cat.", ["case", "ending"]),
        ("", ["banned", "case", "count", "ending", "words"]),
        ("!!!", ["banned", "case", "count", "ending", "words"]),
    ],
)
def test_check_on_hand_written_answers(answer, failed):
    met = FULL.check(answer)
    assert set(met) == {"words", "case", "count", "banned", "ending"}
    assert sorted(name for name, ok in met.items() if not ok) == failed


@pytest.mark.parametrize(
    ("case", "answer", "ok"),
    [("title", "Cat Sun", True), ("title", "Cat sun", False), ("title", "CAT SUN", False),
     ("lower", "cat sun", True), ("lower", "cat Sun", False), ("upper", "CAT SUN", True)],
)  # fmt: skip
def test_casing(case, answer, ok):
    met = Instruction(("cat", "sun"), case).check(answer)
    assert met == {"words": True, "case": ok}


def test_every_demonstrated_answer_meets_its_own_constraints():
    task, rng = GeneralTask(), random.Random(0)
    for _ in range(500):
        instruction = task.sample(rng)
        assert all(instruction.check(instruction.answer).values()), instruction
        assert len(instruction.answer) <= 15


def test_the_held_out_split_is_disjoint_fixed_and_distinct():
    env = GeneralEnv()
    rng = random.Random(0)
    train = {env.sample_task(rng, "train").canonical for _ in range(3000)}
    heldout = env.heldout_tasks(200, seed=1234)
    canon = [t.canonical for t in heldout]
    assert len(set(canon)) == 200 and not train & set(canon)
    assert all(is_heldout(c, 0.1) for c in canon) and not any(is_heldout(c, 0.1) for c in train)
    assert [t.canonical for t in env.heldout_tasks(200, seed=1234)] == canon


def test_the_run_config_builds_the_task_and_its_reward():
    config = load_config("general", ["tasks.general.max_words=2"])
    env = load_environment("general", {"constraint_fraction": 1.0}, EnvContext.of(config))
    assert isinstance(env, GeneralEnv) and env.config.max_words == 2 and env.config.max_tokens == 24
    assert env.config.constraint_fraction == 1.0
    assert all(env.sample_task(random.Random(i)).count is not None for i in range(20))


@pytest.mark.parametrize(("answer_of", "accuracy"), [(lambda i: i.answer, 1.0), (lambda i: i.answer.swapcase(), 0.0)])
def test_held_out_evaluation_counts_the_rules_verdict(answer_of, accuracy):
    env = GeneralEnv()
    by_prompt = {t.prompt: t for t in env.heldout_tasks(50, seed=3)}
    # An engine that answers each instruction the gateway renders with `answer_of(instruction)`.
    engine = ScriptedEngine(lambda text: answer_of(by_prompt[text.removeprefix(USER).removesuffix(ASSISTANT)]) + EOS)

    async def go():
        async with evaluation_gateway(RunConfig(), [engine], TOKENIZER) as gateway:
            return await evaluate_env(env, gateway, num_problems=50, seed=3)

    result = asyncio.run(go())
    assert (result.accuracy, result.statuses) == (accuracy, {"ok": 50})
    assert len(engine.requests) == 50 and {sampling.temperature for _, sampling in engine.requests} == {0.0}


def test_the_general_task_meets_the_environment_contract():
    report = check_environment(load_environment("general", {}, EnvContext()), episodes=3, eval_episodes=3)
    assert all(0.0 <= r.reward <= 1.0 and "constraints_met" in r.metrics for r in report.results)


def test_sft_mixes_general_demonstrations_from_the_training_split_only():
    stream = demo_stream(RunConfig(sft={"tool_demo_fraction": 0.1, "general_demo_fraction": 0.4}), TOKENIZER, seed=0)
    demos = stream.batch(2000)
    general = [d for d in demos if TOKENIZER.decode(d.token_ids).startswith(USER + "Use ")]
    assert abs(len(general) / 2000 - 0.4) < 0.05
    prompts = set()
    for demo in general:
        text = TOKENIZER.decode(demo.token_ids)
        prompt, answer = text[len(USER) :].split(ASSISTANT)
        prompts.add(prompt)
        # Trained: exactly the answer the policy writes and its EOS.
        assert TOKENIZER.decode([t for t, m in zip(demo.token_ids, demo.loss_mask, strict=True) if m]) == answer
        assert answer.endswith(EOS)
    heldout = {t.prompt for t in GeneralEnv().heldout_tasks(300, seed=0)}
    assert len(prompts) > 300 and not heldout & prompts


def test_general_demonstrations_are_off_by_default_and_bounded():
    assert SFTConfig().general_demo_fraction == 0.0
    with pytest.raises(ValueError, match="must not exceed 1"):
        SFTConfig(tool_demo_fraction=0.6, general_demo_fraction=0.5)
    assert GeneralTaskConfig().reward == "constraints"
