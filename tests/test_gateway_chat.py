"""The gateway end to end with the official `openai` client: token-exact multi-turn tool chats, the
learner samples they assemble into, forks on rewritten context, text completions and token calls."""

from __future__ import annotations

import itertools
import json
import uuid

import pytest
from conftest import REDIS_URL, redis_or_skip
from gateway_helpers import TOKENIZER, TOOLS, LiveGateway, make_engine, make_service

from asyncrl.gateway.store import open_store
from asyncrl.samples import trajectory_to_samples


@pytest.fixture(scope="module")
def engine():
    engine = make_engine("e0")
    yield engine
    engine.shutdown()


def _store(kind: str, tmp_path):
    if kind == "sqlite":
        return open_store(tmp_path)
    redis_or_skip().close()
    return open_store(REDIS_URL, namespace=f"test-gateway-{uuid.uuid4().hex}")


@pytest.fixture
def gateway(engine, tmp_path):
    # Some calls here ask for their own sampling options (greedy token calls); refusal has its own tests
    # (test_sampling_record.py).
    with LiveGateway(make_service(open_store(tmp_path), [engine], sampling_overrides="allow")) as gw:
        yield gw


def _echo(message) -> dict:
    """The assistant message as an agent sends it back: through JSON, as the openai client dumps it."""
    return json.loads(message.model_dump_json(exclude_none=True))


def _tool_chat(client, messages: list[dict], turns: int) -> list[dict]:
    for _ in range(turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, logprobs=True)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == ("f", {"a": "7"})
        messages = [*messages, _echo(choice.message), {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    return messages


@pytest.mark.parametrize("store_kind", ["sqlite", "redis"])
def test_multi_turn_tool_chat_is_token_exact_and_assembles_one_masked_sample(engine, tmp_path, store_kind) -> None:
    store = _store(store_kind, tmp_path)
    with LiveGateway(make_service(store, [engine])) as gw:
        rollout_id, key = gw.open(task="arith", group_id="g1", metadata={"n": 1})
        client = gw.openai(key)
        replies_logprobs = []
        messages = [{"role": "system", "content": "Use f."}, {"role": "user", "content": "go"}]
        for _ in range(3):
            reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, logprobs=True)
            replies_logprobs.append([t.logprob for t in reply.choices[0].logprobs.content])
            assert reply.model_extra["asyncrl"] == {
                "rollout_id": rollout_id,
                "turn_index": len(replies_logprobs) - 1,
                "branch": 0,
                "engine_id": "e0",
            }
            call = reply.choices[0].message.tool_calls[0]
            messages += [_echo(reply.choices[0].message), {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        assert gw.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": 0.5, "metrics": {"steps": 3}}).status_code == 200

    trajectory = store.get(rollout_id)
    assert (trajectory.status, trajectory.reward, trajectory.task, trajectory.group_id) == ("ok", 0.5, "arith", "g1")
    turns = trajectory.turns
    assert [t.index for t in turns] == [0, 1, 2] and {t.branch for t in turns} == {0}
    for earlier, later in itertools.pairwise(turns):
        so_far = earlier.prompt_token_ids + earlier.completion_token_ids
        assert later.prompt_token_ids[: len(so_far)] == so_far  # bit-exact reuse of what was sampled
    for turn, logprobs in zip(turns, replies_logprobs, strict=True):
        assert turn.logprobs == logprobs  # what the agent saw is what was recorded
        assert turn.engine_id == "e0" and turn.versions == [0] * len(turn.completion_token_ids)
        assert turn.finish_reason == "stop" and {"engine_call_s", "gateway_s", "total"} <= set(turn.timings)

    (sample,) = trajectory_to_samples(trajectory)
    last = turns[-1]
    assert sample.token_ids == last.prompt_token_ids + last.completion_token_ids
    sampled_positions = set()
    for turn in turns:
        start = len(turn.prompt_token_ids)
        sampled_positions |= set(range(start, start + len(turn.completion_token_ids)))
        assert sample.token_ids[start : start + len(turn.completion_token_ids)] == turn.completion_token_ids
        assert sample.logprobs[start : start + len(turn.completion_token_ids)] == turn.logprobs
    assert [i for i, m in enumerate(sample.loss_mask) if m] == sorted(sampled_positions)
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if not m)
    # The tool results between turns are the environment's: rendered, never trained on.
    observation = TOKENIZER.convert_tokens_to_ids("<|observation|>")
    assert all(m == 0 for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if t == observation)
    store.close()


def test_a_context_rewrite_forks_the_trajectory(gateway) -> None:
    rollout_id, key = gateway.open()
    client = gateway.openai(key)
    start = [{"role": "user", "content": "first question"}]
    messages = _tool_chat(client, start, turns=2)
    edited = [{"role": "user", "content": "edited question"}, *messages[1:]]
    reply = client.chat.completions.create(model="policy", messages=edited, tools=TOOLS)
    assert reply.model_extra["asyncrl"]["branch"] == 1
    gateway.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": 1.0}).raise_for_status()

    trajectory = gateway.service.store.get(rollout_id)
    assert [t.branch for t in trajectory.turns] == [0, 0, 1]
    samples = trajectory_to_samples(trajectory)
    assert len(samples) == 2 and {s.reward for s in samples} == {1.0}
    assert samples[0].turn_indices == [0, 1] and samples[1].turn_indices == [2]


def test_text_completions_reuse_exact_tokens_and_token_calls_are_recorded(gateway) -> None:
    rollout_id, key = gateway.open()
    client = gateway.openai(key)
    first = client.completions.create(model="policy", prompt="<|user|>hi<|assistant|>", max_tokens=4, logprobs=1)
    text = first.choices[0].text
    assert len(first.choices[0].logprobs.token_logprobs) == first.usage.completion_tokens
    second = client.completions.create(model="policy", prompt="<|user|>hi<|assistant|>" + text + "<|user|>again", max_tokens=4)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens  # the first turn, reused
    assert second.model_extra["asyncrl"]["turn_index"] == 1

    tokens = gateway.http.post(
        "/v1/tokens/generate",
        json={"prompt_token_ids": [4, 40, 41, 5], "max_tokens": 3, "temperature": 0},
        headers={"Authorization": f"Bearer {key}"},
    ).json()
    assert tokens["turn_index"] == 2 and len(tokens["token_ids"]) == len(tokens["logprobs"]) == len(tokens["versions"])

    turns = gateway.service.store.get(rollout_id).turns
    first_sequence = turns[0].prompt_token_ids + turns[0].completion_token_ids
    first_sequence = first_sequence[:-1] if first_sequence[-1] == TOKENIZER.eos_token_id else first_sequence
    assert turns[1].prompt_token_ids[: len(first_sequence)] == first_sequence
    assert turns[2].prompt_token_ids == [4, 40, 41, 5] and turns[2].completion_token_ids == tokens["token_ids"]
    assert [(t.temperature, t.top_p, t.top_k) for t in turns] == [(1.0, 1.0, 0), (1.0, 1.0, 0), (0.0, 1.0, 0)]
