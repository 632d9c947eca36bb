"""reasoning-gym tasks (`env: reasoning_gym`): options, the held-out split, the generator's scores, ASCII, the real loop."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
from loop_helpers import run_config, run_in_process, started

from asyncrl.configs.context import EnvContext
from asyncrl.envs.base import Environment, OffersDemonstrations
from asyncrl.envs.procedural import GeneratorError, ReasoningGymEnv
from asyncrl.envs.registry import load_environment
from asyncrl.jobs.contract import check_environment

pytest.importorskip("reasoning_gym")
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"], "allow_parentheses": False}


def make(**options) -> ReasoningGymEnv:
    env = load_environment("reasoning_gym", {"generator": "basic_arithmetic", "generator_options": SMALL, **options}, EnvContext(seed=3))
    assert isinstance(env, ReasoningGymEnv)
    return env


class ScriptedClient:
    """Answers every chat call with `reply`, recording the messages it was sent."""

    def __init__(self, reply: str | None) -> None:
        self.reply, self.sent = reply, []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, **request):
        self.sent.append(request)
        message = SimpleNamespace(content=self.reply)
        return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason="stop")], usage=SimpleNamespace(completion_tokens=3))


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({}, "generator"),
        ({"generator": "no_such_gen"}, "available: ab, acre"),
        ({"generator": "basic_arithmetic", "sizes": 3}, "sizes"),
        ({"generator": "basic_arithmetic", "heldout_fraction": 1.5}, "heldout_fraction"),
        ({"generator": "basic_arithmetic", "prompt_template": "Q: {q}"}, "prompt_template"),
        ({"generator": "basic_arithmetic", "generator_options": {"max_term": 2}}, "its fields: min_terms, max_terms"),
        ({"generator": "basic_arithmetic", "generator_options": {"operators": ["%"]}}, "unsupported operator"),
        ({"generator": "basic_arithmetic", "generator_options": {"seed": 1}}, "generator_options: seed"),
    ],
)
def test_bad_options_name_the_key(options, names):
    with pytest.raises(GeneratorError) as failure:
        load_environment("reasoning_gym", options, EnvContext())
    assert names in str(failure.value)


def test_splits_are_disjoint_in_content_and_seeded():
    env = make(heldout_fraction=0.3)
    assert isinstance(env, Environment) and isinstance(env, OffersDemonstrations)
    rng = random.Random(0)
    train = {env.sample_task(rng, "train").question for _ in range(300)}
    held = {env.sample_task(rng, "eval").question for _ in range(300)}
    assert train and held and not train & held  # 81 one-digit sums, drawn from all seeds: only the hash keeps them apart
    assert [env.sample_task(random.Random(5)).index for _ in range(3)] == [env.sample_task(random.Random(5)).index] * 3
    heldout = env.heldout_tasks(10, seed=1)
    assert len({item.question for item in heldout}) == 10 and [i.index for i in heldout] == [i.index for i in env.heldout_tasks(10, 1)]
    demo = env.demonstration(random.Random(2)).messages
    assert demo[-1]["role"] == "assistant" and demo[0]["content"] not in held
    with pytest.raises(GeneratorError, match="fewer than 500"):
        env.heldout_tasks(500, seed=1)


def test_the_generators_own_score_is_the_reward_and_garbage_scores_zero():
    env = make(system_prompt="Be brief.", answer_format="Answer with the number only.")
    item = env.sample_task(random.Random(1))

    def play(reply):
        client = ScriptedClient(reply)
        result = asyncio.run(env.run_episode(item, client))
        return result, client.sent[0]

    right, request = play(f" {item.answer}\n")
    assert right.reward == 1.0 and right.metrics["correct"] is True and right.metrics["unparseable"] is False
    assert request["messages"][0] == {"role": "system", "content": "Be brief."}
    assert request["messages"][1]["content"] == f"{item.question}\nAnswer with the number only."
    assert request["max_tokens"] == 16  # the run's episode_max_tokens
    wrong, _ = play(str(int(item.answer) + 1))
    assert wrong.status == "ok" and wrong.reward == 0.0 and wrong.metrics["correct"] is False
    for garbage in ("", None, "\x00}{", "9" * 5000):
        result, _ = play(garbage)
        assert result.status == "ok" and result.reward == 0.0 and result.metrics["correct"] is False
    # Partial credit stays partial: reasoning-gym gives len(answer)/len(reply) when the answer is inside the reply.
    partial, _ = play(f"{item.answer} ok")
    assert 0.0 < partial.reward < 1.0 and partial.metrics["correct"] is False


def test_answer_tags_are_read_and_missing_tags_are_unparseable():
    env = make(answer_tag="answer")
    item = env.sample_task(random.Random(4))
    assert env.demonstration(random.Random(4)).messages[-1]["content"].startswith("<answer>")
    tagged = asyncio.run(env.run_episode(item, ScriptedClient(f"think <answer>{item.answer}</answer>")))
    bare = asyncio.run(env.run_episode(item, ScriptedClient(item.answer)))
    assert tagged.metrics["correct"] and bare.reward == 0.0 and bare.metrics["unparseable"]


def test_text_the_tokenizer_cannot_write_is_skipped_or_refused():
    with pytest.raises(GeneratorError, match="not printable ASCII"):
        load_environment("reasoning_gym", {"generator": "emoji_mystery"}, EnvContext())
    # sentence_reordering has a few items with non-ASCII words: they are never drawn.
    env = load_environment("reasoning_gym", {"generator": "sentence_reordering", "size": 200}, EnvContext())
    rng = random.Random(0)
    items = [env.sample_task(rng, split) for split in ("train", "eval") for _ in range(100)]
    assert all(ch == "\n" or " " <= ch <= "~" for item in items for ch in item.question + item.answer)
    assert sum(env.item(index) is None for index in range(200)) > 0  # there were some to skip
    with pytest.raises(GeneratorError, match="max_question_chars=5"):
        make(max_question_chars=5)  # every question is longer: refused at start-up, naming the limit


def test_a_few_steps_of_the_real_loop_balance_the_ledger(tmp_path):
    mix = "tasks.mix={gym: {env: reasoning_gym, options: {generator: basic_arithmetic, generator_options: {max_terms: 2, max_digits: 1}}}}"
    config = run_config(tmp_path, "name=gym", mix, "loop.steps=2")
    result = asyncio.run(run_in_process(config, None))  # None: the loop builds its task mix from tasks.mix, by name
    state, counts = result["state"], result["counts"]
    assert sum(state.ledger.values()) == started(counts) > 0 and state.ledger["trained"] > 0
    assert counts["acked"] == started(counts) and counts["running"] == counts["pending"] == counts["claimed"] == 0
    assert state.ledger.get("dropped_crash", 0) == 0  # every episode ran and was scored
    evals = [r for r in result["records"] if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2] and all(0.0 <= r["eval_accuracy"] <= 1.0 for r in evals)


def test_the_env_meets_the_environment_contract():
    report = check_environment(make(heldout_fraction=0.3))  # a real gateway and engine; raises ContractError listing problems
    assert report.results and all(0.0 <= r.reward <= 1.0 and r.status == "ok" for r in report.results)


def test_sft_takes_its_demonstrations_and_held_out_split_from_the_task_sft_task_names():
    from asyncrl.configs import ConfigError, load_config
    from asyncrl.jobs.sft import base_task, demo_stream
    from asyncrl.policy.tokenizer import build_tokenizer

    config = load_config("reasoning_gym", ["sft.tool_demo_fraction=0.0"])
    assert base_task(config) == ("reasoning_gym", config.tasks.mix["simple_equations"].options)
    tokenizer = build_tokenizer()
    texts = [tokenizer.decode(demo.token_ids) for demo in demo_stream(config, tokenizer).batch(3)]
    assert all("Solve for" in text or "=" in text for text in texts), texts  # the generator's equations, not arithmetic
    assert base_task(load_config("quickstart", [])) == ("reasoning", {})
    with pytest.raises(ConfigError, match=r"sft.task 'nope' is not a task of tasks.mix \(its tasks: simple_equations\)"):
        load_config("reasoning_gym", ["sft.task=nope"])
