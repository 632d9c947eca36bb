"""Engine behaviour: continuous batching, prefix reuse over the paged cache, weight updates, stopping, bad input."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import make_tiny_model, run_to_completion
from test_engine_front import check_closed_caller, check_idle_exit

from asyncrl.configs.schema import EmbeddedRolloutConfig
from asyncrl.records import RequestError, SamplingParams
from asyncrl.rollout import EmbeddedEngine

PROMPT = [5, 17, 33, 9, 64, 2, 71]
BLOCK = 4
"""Small blocks, so that these short prompts span several and share whole ones."""


def reusable(tokens_with_kv: int) -> int:
    """Positions a later request can reuse of a context whose first `tokens_with_kv` have KV: whole blocks only."""
    return tokens_with_kv // BLOCK * BLOCK


@pytest.fixture(scope="module")
def model():
    """No EOS, so every request runs to max_tokens and lengths are known in advance."""
    return make_tiny_model("glm_moe_dsa", eos_token_id=None, seed=1)


def new_engine(model, **options) -> EmbeddedEngine:
    return EmbeddedEngine(model, EmbeddedRolloutConfig(**{"max_num_seqs": 8, "kv_block_size": BLOCK, **options}))


def assert_same_sample(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_requests_joining_mid_decode_sample_what_they_would_alone(model):
    prompts = [PROMPT, [40, 41, 42], list(range(20, 45)), [99] * 12]
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10 + 3 * i, seed=100 + i) for i in range(4)]
    alone = [run_to_completion(new_engine(model), [(p, s)])[0] for p, s in zip(prompts, params, strict=False)]

    engine = new_engine(model)
    ids = [engine.add_request(prompts[0], params[0]), engine.add_request(prompts[1], params[1])]
    done = {}
    for _ in range(4):  # the first two are decoding when the others arrive
        done.update((r.request_id, r) for r in engine.step())
    ids += [engine.add_request(prompts[2], params[2]), engine.add_request(prompts[3], params[3])]
    while engine.has_unfinished():
        done.update((r.request_id, r) for r in engine.step())
    for i, expected in zip(ids, alone, strict=False):
        assert_same_sample(done[i], expected)
        assert done[i].finish_reason == "length"


def test_max_num_seqs_queues_the_rest(model):
    engine = new_engine(model, max_num_seqs=2)
    params = SamplingParams(temperature=1.0, max_tokens=5, seed=1)
    results = run_to_completion(engine, [(PROMPT, params)] * 5)
    assert all(len(r.token_ids) == 5 for r in results)
    assert all(r.token_ids == results[0].token_ids for r in results)  # same seed, same prompt


def test_next_turn_of_a_session_reuses_the_prefix_and_samples_the_same(model):
    turn1 = SamplingParams(temperature=1.0, max_tokens=6, seed=1)
    turn2 = SamplingParams(temperature=1.0, max_tokens=8, seed=2)
    engine = new_engine(model)
    (first,) = run_to_completion(engine, [(PROMPT, turn1)], session_id="rollout-1")
    # The prompt and all but the last sampled token have KV: their whole blocks stay cached.
    assert engine.health()["kv_blocks_cached"] == reusable(len(PROMPT) + 6 - 1) // BLOCK
    second_prompt = PROMPT + first.token_ids + [11, 12, 13]  # e.g. a tool response
    (second,) = run_to_completion(engine, [(second_prompt, turn2)], session_id="rollout-1")
    assert second.cached_prompt_tokens == reusable(len(PROMPT) + len(first.token_ids) - 1) > 0
    (fresh,) = run_to_completion(new_engine(model), [(second_prompt, turn2)])
    assert fresh.cached_prompt_tokens == 0
    assert_same_sample(second, fresh)


def test_prefix_reuse_takes_whole_blocks_up_to_the_first_differing_token_whatever_the_session(model):
    """The cache is keyed by content: the same tokens under the same weights have the same KV, whoever asks."""
    params = SamplingParams(temperature=0, max_tokens=4)
    engine = new_engine(model)
    run_to_completion(engine, [(PROMPT, params)], session_id="a")
    (other,) = run_to_completion(engine, [([*PROMPT, 3], params)], session_id="b")
    assert other.cached_prompt_tokens == BLOCK  # 8 tokens: the last must be fed, so one whole block is reused
    (edited,) = run_to_completion(engine, [([*PROMPT[:3], 8, 8, 8, 8, 8], params)], session_id="a")
    assert edited.cached_prompt_tokens == 0  # differs inside the first block
    (kept,) = run_to_completion(engine, [([*PROMPT[:4], 8, 8, 8, 8, 8], params)])
    assert kept.cached_prompt_tokens == BLOCK
    (fresh,) = run_to_completion(new_engine(model), [([*PROMPT[:4], 8, 8, 8, 8, 8], params)])
    assert_same_sample(kept, fresh)


def test_a_groups_prompt_is_prefilled_once_and_its_members_sample_what_they_would_alone(model):
    """Members behind the first wait one step for its prompt blocks, copy the partial last one, and feed only
    their last prompt token (its logits are theirs to sample from)."""
    prompt = list(range(3, 3 + 4 * BLOCK + 2))  # four whole blocks and two tokens
    params = [SamplingParams(temperature=1.0, max_tokens=5, seed=50 + i) for i in range(8)]
    alone = [run_to_completion(new_engine(model), [(prompt, p)])[0] for p in params]
    engine = new_engine(model)
    group = run_to_completion(engine, [(prompt, p) for p in params])
    assert engine.health()["prefill_tokens"] == len(prompt) + 7
    assert [r.cached_prompt_tokens for r in group] == [0] + [len(prompt) - 1] * 7
    for mine, expected in zip(group, alone, strict=True):
        assert_same_sample(mine, expected)


def test_weight_update_mid_request_switches_versions_without_dropping_it(model):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=4)
    (baseline,) = run_to_completion(new_engine(model), [(PROMPT, params)])
    other = make_tiny_model("glm_moe_dsa", eos_token_id=None, seed=2).state_dict()

    for state, version in ((model.state_dict(), 1), (other, 7)):
        engine = new_engine(model)
        request = engine.add_request(PROMPT, params)
        for _ in range(5):
            assert engine.step() == []
        engine.update_weights(state, version)
        assert engine.health()["version"] == version
        (result,) = [r for _ in range(20) for r in engine.step()][:1]
        assert result.request_id == request and result.finish_reason == "length"
        assert result.versions == [0] * 5 + [version] * 7
        assert result.kv_versions == [0] * 5 + [version] * 7  # recomputed under the new weights at the push
        assert result.token_ids[:5] == baseline.token_ids[:5]
        if version == 1:  # the same weights again: nothing else changes
            assert_same_sample(result, baseline)
        else:  # tokens after the swap come from the new weights
            assert result.logprobs[5] != pytest.approx(baseline.logprobs[5], abs=1e-3)


def test_a_push_under_recompute_serves_no_block_the_old_weights_computed(model):
    engine = new_engine(model)
    params = SamplingParams(temperature=0, max_tokens=3)
    run_to_completion(engine, [(PROMPT, params)], session_id="s")
    assert engine.health()["kv_blocks_cached"] > 0
    engine.update_weights(model.state_dict(), 1)
    assert engine.health()["kv_blocks_cached"] == 0
    (again,) = run_to_completion(engine, [(PROMPT, params)], session_id="s")
    assert again.cached_prompt_tokens == 0 and again.kv_versions == [1] * 3


def test_a_push_under_keep_reuses_old_blocks_and_says_so_per_token(model):
    engine = new_engine(model, kv_on_push="keep")
    params = SamplingParams(temperature=0, max_tokens=3)
    (first,) = run_to_completion(engine, [(PROMPT, params)])
    engine.update_weights(model.state_dict(), 1)
    (again,) = run_to_completion(engine, [([*PROMPT, *first.token_ids, 9], params)])
    assert again.cached_prompt_tokens == reusable(len(PROMPT) + 2) > 0
    assert again.versions == [1] * 3 and again.kv_versions == [0] * 3


@pytest.mark.parametrize("kv_on_push", ["recompute", "keep"])
def test_a_request_running_at_a_push_records_the_kv_it_attended_to(model, kv_on_push):
    """recompute: its context is prefilled again under the new weights, so every later token attended to new KV
    only; keep: later tokens still attend to the KV the old weights computed."""
    params = SamplingParams(temperature=0, max_tokens=6)
    engine = new_engine(model, kv_on_push=kv_on_push)
    request = engine.add_request(PROMPT, params, session_id="s")
    for _ in range(3):
        assert engine.step() == []
    engine.update_weights(model.state_dict(), 1)
    (first,) = [r for _ in range(10) for r in engine.step()][:1]
    assert first.request_id == request and first.versions == [0] * 3 + [1] * 3
    assert first.kv_versions == [0] * 3 + ([1] * 3 if kv_on_push == "recompute" else [0] * 3)
    assert engine.health()["preemptions"] == (1 if kv_on_push == "recompute" else 0)
    (alone,) = run_to_completion(new_engine(model), [(PROMPT, params)])
    assert_same_sample(first, alone)  # the same weights again: recomputing changes nothing sampled


def test_a_bad_state_dict_is_refused_and_the_old_weights_stay(model):
    engine = new_engine(model)
    broken = {k: v for k, v in model.state_dict().items() if "lm_head" not in k}
    with pytest.raises(KeyError, match="lm_head"):
        engine.update_weights(broken, 3)
    assert engine.version == 0
    params = SamplingParams(temperature=0, max_tokens=4)
    assert_same_sample(run_to_completion(engine, [(PROMPT, params)])[0], run_to_completion(new_engine(model), [(PROMPT, params)])[0])


def test_stop_tokens_and_eos_end_a_request_and_are_returned(model):
    (free,) = run_to_completion(new_engine(model), [(PROMPT, SamplingParams(temperature=0, max_tokens=10))])
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=(stop,))
    (stopped,) = run_to_completion(new_engine(model), [(PROMPT, params)])
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: first + 1]

    with_eos = make_tiny_model("glm_moe_dsa", eos_token_id=stop, seed=1)
    (eos,) = run_to_completion(new_engine(with_eos), [(PROMPT, SamplingParams(temperature=0, max_tokens=10))])
    assert eos.finish_reason == "stop" and eos.token_ids == free.token_ids[: first + 1]
    assert free.finish_reason == "length" and len(free.token_ids) == 10


def test_abort_finishes_a_request_early(model):
    engine = new_engine(model)
    request = engine.add_request(PROMPT, SamplingParams(max_tokens=50))
    engine.step()
    engine.abort(request)
    (result,) = engine.step()
    assert result.finish_reason == "abort" and len(result.token_ids) == 1
    assert not engine.has_unfinished()


BAD_REQUESTS = {
    "token above vocab": ([1, 2, 128], {}),
    "negative token": ([1, -1], {}),
    "not a token": ([1, "x"], {}),
    "fractional token": ([1, 2.5], {}),
    "empty prompt": ([], {}),
    "max_tokens zero": ([1, 2], {"max_tokens": 0}),
    "too long": ([1] * 100, {"max_tokens": 29}),
    "unknown option": ([1, 2], {"temprature": 0.5}),
    "negative temperature": ([1, 2], {"temperature": -1.0}),
    "vanishing temperature": ([1, 2], {"temperature": 1e-300}),
    "top_p zero": ([1, 2], {"top_p": 0.0}),
}


def test_bad_requests_fail_alone_while_others_finish(model):
    engine = new_engine(model)

    async def scenario():
        good = [asyncio.create_task(engine.generate(PROMPT, {"max_tokens": 20, "seed": i})) for i in range(3)]
        await asyncio.sleep(0)
        errors = {}
        for name, (prompt, options) in BAD_REQUESTS.items():
            with pytest.raises(RequestError) as caught:
                await engine.generate(prompt, options)
            errors[name] = str(caught.value)
        return await asyncio.gather(*good), errors

    results, errors = asyncio.run(scenario())
    engine.shutdown()
    assert [len(r.token_ids) for r in results] == [20, 20, 20]
    assert "128" in errors["token above vocab"] and "temprature" in errors["unknown option"]
    assert "max_model_len 128" in errors["too long"]
    assert "use 0 for greedy" in errors["vanishing temperature"]
    assert engine.health()["last_error"] is None


def test_async_generate_with_a_concurrent_weight_update(model):
    engine = new_engine(model, max_num_seqs=4)
    other = make_tiny_model("glm_moe_dsa", eos_token_id=None, seed=3).state_dict()
    advance = engine.advance

    def advance_only_once_the_push_is_queued() -> list:
        # The push lands mid-request on any machine: once the request's first token is out, the stepping
        # thread takes no further step until the push is queued (the next step applies it). Left alone, a
        # fast stepping thread could finish all 110 tokens before the push's thread got to run.
        if engine.generated_tokens > 0 and engine.version == 0:
            with engine._cv:
                engine._cv.wait_for(lambda: engine._push is not None, timeout=120)  # the limit only bounds a hang
        return advance()

    engine.advance = advance_only_once_the_push_is_queued

    async def scenario():
        task = asyncio.create_task(engine.generate(PROMPT, {"max_tokens": 110, "seed": 0}))
        while engine.health()["generated_tokens"] == 0:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.update_weights, other, 5)
        after = await engine.generate([3, 4], {"max_tokens": 3})
        return await task, after

    result, after = asyncio.run(scenario())
    engine.shutdown()
    assert len(result.token_ids) == 110 and result.finish_reason == "length"
    assert result.versions[0] == 0 and result.versions[-1] == 5 and result.versions == sorted(result.versions)
    assert after.versions == [5, 5, 5]
    health = engine.health()
    assert health["version"] == 5 and health["running"] == 0 and health["generated_tokens"] == 113


def test_health_reports_a_shut_down_engine_as_not_alive(model):
    engine = new_engine(model)
    assert engine.health()["alive"]
    asyncio.run(engine.generate(PROMPT, {"max_tokens": 2}))
    assert engine.health()["alive"]
    engine.shutdown()
    assert not engine.health()["alive"]


def test_idle_stepping_thread_leaves_and_the_next_request_restarts_it(model):
    engine = new_engine(model)
    try:
        check_idle_exit(engine, PROMPT, {"max_tokens": 3, "seed": 1}, model.state_dict(), 2)
    finally:
        engine.shutdown()


def test_a_caller_whose_event_loop_closed_costs_nobody_else_their_result(model):
    engine = new_engine(model)
    params = SamplingParams(temperature=0.0, max_tokens=8)  # the same prompt: both finish in the same step
    try:
        check_closed_caller(engine, lambda: engine.generate(PROMPT, params))
    finally:
        engine.shutdown()


def test_a_prompt_longer_than_a_prefill_piece_is_prefilled_over_steps_and_samples_the_same(model):
    long_prompt = [(7 * i) % 90 + 3 for i in range(70)]  # several pieces of 16, past the tiny model's index_topk
    prompts = [long_prompt, PROMPT, long_prompt[:33]]
    params = [SamplingParams(temperature=1.0, max_tokens=6, seed=11 + i) for i in range(3)]
    whole = run_to_completion(new_engine(model), list(zip(prompts, params, strict=True)))
    pieces = new_engine(model, prefill_chunk_tokens=16)
    ids = [pieces.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
    longest = None
    done, steps = {}, 0
    while pieces.has_unfinished():
        done.update((r.request_id, r) for r in pieces.step())
        steps += 1
        longest = longest or next(r for r in pieces.scheduler.running if r.id == ids[0])
        if steps < 5:  # ceil(70 / 16) pieces: the prompt's KV grows a piece a step, nothing sampled yet
            assert longest.computed == 16 * steps and not longest.output
    assert len(longest.output) == 6
    for request_id, expected in zip(ids, whole, strict=True):
        assert_same_sample(done[request_id], expected)
    # A cached prefix plus a long new suffix: the suffix is prefilled in pieces after the cached part.
    first = run_to_completion(pieces, [(PROMPT, SamplingParams(max_tokens=3, seed=1))], session_id="s")[0]
    follow = [*PROMPT, *first.token_ids, *long_prompt[:40]]
    again = run_to_completion(pieces, [(follow, SamplingParams(temperature=1.0, max_tokens=5, seed=3))], session_id="s")[0]
    fresh = run_to_completion(new_engine(model), [(follow, SamplingParams(temperature=1.0, max_tokens=5, seed=3))])[0]
    assert again.cached_prompt_tokens == reusable(len(PROMPT) + len(first.token_ids) - 1)
    assert_same_sample(again, fresh)
