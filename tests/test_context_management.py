"""Agent context management (envs/context.py): the strategies on message lists (valid requests, tool
calls kept with their results, system prompt and task kept), their settings, and what a trimmed
episode leaves on record: real gateways over loopback, the official `openai` client, the branches
the conversation forks into and the learner samples they assemble into."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from collections import defaultdict

import openai
import pytest
from gateway_helpers import TOKENIZER, TOOLS, LiveGateway, ScriptedEngine, make_engine, make_service

from asyncrl.configs.schema import ProcessSandboxConfig
from asyncrl.envs.agentic import AgenticEnv
from asyncrl.envs.context import (
    ContextError,
    DiscardAll,
    Full,
    KeepLast,
    context_strategy,
    message_chars,
    split_turns,
)  # fmt: skip
from asyncrl.envs.registry import load_environment
from asyncrl.envs.sandbox import open_backend
from asyncrl.envs.tool_demos import ToolProblem
from asyncrl.gateway.store import open_store
from asyncrl.policy.tokenizer import ARG_KEY_CLOSE, ARG_KEY_OPEN, ARG_VALUE_CLOSE, ARG_VALUE_OPEN, EOS, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from asyncrl.records import Trajectory
from asyncrl.samples import trajectory_to_samples

SYSTEM = {"role": "system", "content": "Use the tools."}
TASK = {"role": "user", "content": "Find the answer."}


def _history(rng: random.Random, turns: int) -> list[dict]:
    """System prompt and task, then `turns` turns of 0-3 tool calls each with their results, some with a user follow-up."""
    messages: list[dict] = [SYSTEM, TASK]
    for t in range(turns):
        calls = [
            {"id": f"call_{t}_{c}", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": "x" * rng.randint(0, 9)})}}
            for c in range(rng.randint(0, 3))
        ]
        messages.append({"role": "assistant", "content": "thinking " * rng.randint(0, 3), **({"tool_calls": calls} if calls else {})})
        messages += [{"role": "tool", "tool_call_id": call["id"], "content": f"result {t}.{c}"} for c, call in enumerate(calls)]
        if rng.random() < 0.25:
            messages.append({"role": "user", "content": f"follow-up {t}"})
    return messages


def _assert_valid_request(messages: list) -> None:
    """Starts with the system prompt and the task; every tool message answers a call of the assistant
    message before it, and every call is answered before the next assistant or user message."""
    assert messages[:2] == [SYSTEM, TASK]
    unanswered: set[str] = set()
    for message in messages[2:]:
        if message["role"] == "tool":
            assert message["tool_call_id"] in unanswered, f"a tool result without its call: {message}"
            unanswered.remove(message["tool_call_id"])
            continue
        assert not unanswered, f"calls {unanswered} lost their results"
        if message["role"] == "assistant":
            unanswered = {call["id"] for call in message.get("tool_calls") or ()}
    assert not unanswered


def _turns(messages: list) -> list[list]:
    return split_turns(messages)[1]


def test_a_history_splits_into_the_head_and_turns_that_keep_calls_with_their_results() -> None:
    history = _history(random.Random(1), turns=6)
    head, turns = split_turns(history)
    assert head == [SYSTEM, TASK]
    assert [m for turn in turns for m in turn] == history[2:]
    assert all(turn[0]["role"] == "assistant" and all(m["role"] != "assistant" for m in turn[1:]) for turn in turns)
    assert split_turns([TASK]) == ([TASK], [])


@pytest.mark.parametrize("seed", range(20))
def test_every_strategy_sends_a_valid_request_made_of_the_head_and_whole_recent_turns(seed: int) -> None:
    rng = random.Random(seed)
    history = _history(rng, turns=rng.randint(0, 12))
    before = json.dumps(history)
    for strategy in (Full(), KeepLast(turns=1), KeepLast(turns=3), KeepLast(), DiscardAll(max_chars=60), DiscardAll(max_chars=1)):
        sent = strategy.apply(history)
        _assert_valid_request(sent)
        # Whole turns, the latest ones, and the very message objects the agent echoed (nothing rewritten).
        kept = _turns(sent)
        assert kept == _turns(history)[len(_turns(history)) - len(kept) :]
        assert all(any(m is h for h in history) for m in sent)
    assert json.dumps(history) == before  # the full history is the environment's: never changed


def test_keep_last_keeps_the_last_n_turns() -> None:
    history = _history(random.Random(7), turns=8)
    turns = _turns(history)
    for n in (1, 2, 5):
        assert KeepLast(turns=n).apply(history) == [SYSTEM, TASK, *(m for turn in turns[-n:] for m in turn)]
    assert KeepLast(turns=8).apply(history) == KeepLast(turns=50).apply(history) == Full().apply(history) == history
    assert KeepLast().turns == 5  # the report's keep-recent-5


def _replayed_discard_all(history: list, max_chars: int) -> list[list]:
    """What discard-all sends at each call of the episode that built `history`, played call by call:
    before every call, a context grown past the threshold restarts from the head."""
    head, turns = split_turns(history)
    context, sent = list(head), [list(head)]
    for turn in turns:
        context += turn
        if sum(map(message_chars, context)) > max_chars:
            context = list(head)
        sent.append(list(context))
    return sent


@pytest.mark.parametrize(("seed", "max_chars"), [(0, 40), (1, 80), (2, 150), (3, 10_000), (4, 1)])
def test_discard_all_restarts_from_the_head_whenever_the_context_passes_the_threshold(seed: int, max_chars: int) -> None:
    history = _history(random.Random(seed), turns=10)
    head, turns = split_turns(history)
    cuts = [len(head) + sum(len(t) for t in turns[:i]) for i in range(len(turns) + 1)]
    strategy = DiscardAll(max_chars=max_chars)
    # The pure function of the history is the episode's own stateful process at every call.
    assert [strategy.apply(history[:cut]) for cut in cuts] == _replayed_discard_all(history, max_chars)
    for cut in cuts:
        assert sum(map(message_chars, strategy.apply(history[:cut]))) <= max(max_chars, sum(map(message_chars, head)))


def test_discard_all_by_hand() -> None:
    def turn(n: int) -> list[dict]:
        return [{"role": "assistant", "content": "a" * n}]

    head = [SYSTEM, TASK]  # 14 + 16 characters
    t1, t2, t3, t4 = turn(30), turn(30), turn(30), turn(5)
    strategy = DiscardAll(max_chars=100)
    assert strategy.apply([*head, *t1, *t2]) == [*head, *t1, *t2]  # 90 characters: all kept
    assert strategy.apply([*head, *t1, *t2, *t3]) == head  # 120: everything since the task goes
    assert strategy.apply([*head, *t1, *t2, *t3, *t4]) == [*head, *t4]  # and the context grows again from there


def test_message_chars_counts_text_and_tool_calls() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "python", "arguments": '{"code": "1"}'}}
    assert message_chars({"role": "assistant", "content": None, "tool_calls": [call]}) == len("python") + len('{"code": "1"}')
    assert message_chars({"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "text", "text": "de"}]}) == 5
    assert message_chars({"role": "tool", "tool_call_id": "c", "content": "42"}) == 2


def test_strategies_by_name_and_options() -> None:
    assert context_strategy(None) == context_strategy("full") == Full()
    assert context_strategy("keep_last") == KeepLast(turns=5)
    assert context_strategy({"strategy": "keep_last", "turns": 2}) == KeepLast(turns=2)
    assert context_strategy({"strategy": "discard_all", "max_chars": 9000}) == DiscardAll(max_chars=9000)
    own = KeepLast(turns=3)
    assert context_strategy(own) is own


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("keep_first", "unknown strategy 'keep_first'; known: full, keep_last, discard_all"),
        ({"strategy": "keep_last", "turns": 0}, "'keep_last': turns: Input should be greater than or equal to 1"),
        ({"strategy": "keep_last", "turns": "many"}, "'keep_last': turns: Input should be a valid integer"),
        ({"strategy": "keep_last", "window": 5}, "'keep_last': window: Extra inputs are not permitted"),
        ({"strategy": "discard_all"}, "'discard_all': max_chars: Field required"),
        ({"turns": 5}, "say which strategy ('strategy': one of full, keep_last, discard_all)"),
        (5, "expected a strategy name or a mapping with 'strategy', got int"),
    ],
)
def test_a_bad_setting_says_what_is_wrong(spec, message: str) -> None:
    with pytest.raises(ContextError) as error:
        context_strategy(spec)
    assert message in str(error.value)


def test_the_agentic_environment_takes_a_context_option() -> None:
    env = load_environment("agentic", {"context": {"strategy": "keep_last", "turns": 2}, "max_turns": 6})
    assert isinstance(env, AgenticEnv) and env.context == KeepLast(turns=2) and env.config.max_turns == 6
    assert load_environment("agentic").context == Full()
    with pytest.raises(ContextError, match="unknown strategy 'last'"):
        load_environment("agentic", {"context": "last"})


# What a trimmed episode leaves on record.


def _assert_samples_train_every_sampled_token_once(trajectory: Trajectory) -> list:
    """The samples of `trajectory`: each holds its turns' prompts and completions token for token, its
    loss mask covers exactly those completions, and across samples every sampled token is trained once."""
    samples = trajectory_to_samples(trajectory)
    turns = {turn.index: turn for turn in trajectory.turns}
    trained: dict[int, list[int]] = defaultdict(list)
    for sample in samples:
        spans = set()
        for index in sample.turn_indices:
            turn = turns[index]
            start, end = len(turn.prompt_token_ids), len(turn.prompt_token_ids) + len(turn.completion_token_ids)
            assert sample.token_ids[:start] == turn.prompt_token_ids and sample.token_ids[start:end] == turn.completion_token_ids
            assert sample.logprobs[start:end] == turn.logprobs
            spans |= set(range(start, end))
        assert {i for i, m in enumerate(sample.loss_mask) if m} == spans
        assert sample.token_turns is not None
        for token, mask, index in zip(sample.token_ids, sample.loss_mask, sample.token_turns, strict=True):
            if mask:
                trained[index].append(token)
    assert trained == {i: turn.completion_token_ids for i, turn in turns.items()}
    return samples


def _echo(message) -> dict:
    """The assistant message as an agent sends it back: through JSON, as the openai client dumps it."""
    return json.loads(message.model_dump_json(exclude_none=True))


@pytest.fixture(scope="module")
def engine():
    engine = make_engine("e0")  # the scripted tiny policy: it answers every prompt with the call f(a="7")
    yield engine
    engine.shutdown()


def _tool_episode(engine, store, strategy, calls: int) -> tuple[Trajectory, list[int], list[int], list]:
    """An agent loop of `calls` tool calls sending what `strategy` keeps; the finished trajectory, the
    branch and reused prompt tokens each reply reported, and the conversation's branches."""
    with LiveGateway(make_service(store, [engine])) as gw:
        rollout_id, key = gw.open()
        client = gw.openai(key)
        history: list[dict] = [SYSTEM, TASK]
        labels, reused = [], []
        for step in range(calls):
            reply = client.chat.completions.create(model="policy", messages=strategy.apply(history), tools=TOOLS)
            labels.append(reply.model_extra["asyncrl"]["branch"])
            reused.append(reply.usage.prompt_tokens_details.cached_tokens)
            (call,) = reply.choices[0].message.tool_calls
            history += [_echo(reply.choices[0].message), {"role": "tool", "tool_call_id": call.id, "content": f"out {step}"}]
        branches = gw.service.rollouts.live[rollout_id].conversation.branches
        gw.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": 1.0}).raise_for_status()
    trajectory = store.get(rollout_id)
    assert [t.branch for t in trajectory.turns] == labels
    return trajectory, labels, reused, [(b.id, b.parent, b.fork_reason, b.turns) for b in branches]


def test_keep_last_over_tool_turns_forks_from_the_full_history_and_trains_each_sampled_token_once(engine, tmp_path) -> None:
    store = open_store(tmp_path)
    try:
        trajectory, labels, reused, forks = _tool_episode(engine, store, context_strategy({"strategy": "keep_last", "turns": 1}), calls=4)
    finally:
        store.close()
    # The first two calls send the whole history (one turn to keep): one branch. Each later call
    # drops the oldest turn, so it extends no branch: it forks from the full history's at its last
    # turn boundary in common (the task and the first call, which every call here writes alike).
    assert labels == [0, 0, 1, 2]
    assert forks == [(0, None, "fresh", 2), (1, 0, "rewrite", 1), (2, 0, "rewrite", 1)]
    first = trajectory.turns[0]
    assert reused == [0] + [len(first.prompt_token_ids) + len(first.completion_token_ids)] * 3
    seen = [TOKENIZER.decode(t.prompt_token_ids) for t in trajectory.turns]
    assert "out 0" in seen[1] and "out 1" in seen[2] and "out 2" in seen[3]
    assert "out 0" not in seen[2] and "out 1" not in seen[3]  # the dropped turns are gone from the prompt
    samples = _assert_samples_train_every_sampled_token_once(trajectory)
    assert [s.turn_indices for s in samples] == [[0, 1], [2], [3]]
    assert {s.reward for s in samples} == {1.0}


def test_discard_all_restarts_are_forks_and_the_turns_between_them_one_sample(engine, tmp_path) -> None:
    # Head 30 characters, each turn 16 (the call f + '{"a": "7"}', the result "out N"): the context
    # passes 70 after the third turn, so the fourth call restarts from the head.
    store = open_store(tmp_path)
    try:
        trajectory, labels, reused, forks = _tool_episode(engine, store, DiscardAll(max_chars=70), calls=6)
    finally:
        store.close()
    assert labels == [0, 0, 0, 1, 1, 1]
    assert forks == [(0, None, "fresh", 3), (1, None, "rewrite", 3)]
    assert reused[3] == 0 and trajectory.turns[3].prompt_token_ids == trajectory.turns[0].prompt_token_ids  # afresh
    seen = [TOKENIZER.decode(t.prompt_token_ids) for t in trajectory.turns]
    assert "out 0" in seen[2] and "out 1" in seen[2] and "out" not in seen[3]
    assert "out 3" in seen[4] and "out 2" not in seen[4] and "out 4" in seen[5]  # growing again after the restart
    samples = _assert_samples_train_every_sampled_token_once(trajectory)
    assert [s.turn_indices for s in samples] == [[0, 1, 2], [3, 4, 5]]


def _python_call(code: str) -> str:
    return f"{TOOL_CALL_OPEN}python{ARG_KEY_OPEN}code{ARG_KEY_CLOSE}{ARG_VALUE_OPEN}{code}{ARG_VALUE_CLOSE}{TOOL_CALL_CLOSE}{EOS}"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="the process sandbox needs bubblewrap")
def test_the_agentic_environment_with_keep_last_records_a_fresh_fork_per_trimmed_call(tmp_path) -> None:
    replies = [_python_call("print(11)"), _python_call("print(22)"), _python_call("print(33)"), f"42{EOS}"]
    engine = ScriptedEngine(lambda _prompt: replies.pop(0))
    env = load_environment("agentic", {"context": {"strategy": "keep_last", "turns": 1}, "max_turns": 4})
    store = open_store(tmp_path)

    async def episode(gw: LiveGateway, key: str):
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
        sandbox = await open_backend(ProcessSandboxConfig()).open()
        try:
            return await env.run_episode(ToolProblem(6, 7), client, sandbox)
        finally:
            await sandbox.close()
            await client.close()

    try:
        with LiveGateway(make_service(store, [engine])) as gw:
            rollout_id, key = gw.open(task="agentic")
            result = asyncio.run(episode(gw, key))
            branches = gw.service.rollouts.live[rollout_id].conversation.branches
            gw.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": result.reward, "metrics": result.metrics}).raise_for_status()
        assert result.status == "ok" and result.reward == 1.0 and result.metrics["tool_calls"] == 3
        # Each call wrote a different program, so a trimmed request shares no turn boundary with any
        # branch: it is rendered afresh (no parent, nothing reused) and starts a branch of its own.
        forks = [(b.id, b.parent, b.fork_reason, b.turns) for b in branches]
        assert forks == [(0, None, "fresh", 2), (1, None, "rewrite", 1), (2, None, "rewrite", 1)]
        seen = [TOKENIZER.decode(prompt) for prompt, _ in engine.requests]
        assert all("6*7" in prompt for prompt in seen)  # the task is always kept
        assert "print(11)" in seen[1] and "print(11)" not in seen[2] and "print(22)" in seen[2]
        assert "print(22)" not in seen[3] and "print(33)" in seen[3]

        trajectory = store.get(rollout_id)
        assert [t.branch for t in trajectory.turns] == [0, 0, 1, 2]
        samples = _assert_samples_train_every_sampled_token_once(trajectory)
        assert [s.turn_indices for s in samples] == [[0, 1], [2], [3]]
        # The re-rendered earlier call in a trimmed prompt is context there, trained only where it was sampled.
        trained = [t for t, m in zip(samples[1].token_ids, samples[1].loss_mask, strict=True) if m]
        assert TOKENIZER.decode(trained) == _python_call("print(33)")
    finally:
        store.close()
