"""The paged KV cache: the block manager's books, paged attention equal to one block per request, preemption
that recomputes exactly, and a cache too small for a request refused naming the setting."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model, run_to_completion
from families import tiny_family_model

from asyncrl.configs.schema import EmbeddedRolloutConfig
from asyncrl.records import RequestError, SamplingParams
from asyncrl.rollout import EmbeddedEngine
from asyncrl.rollout.kv_blocks import NULL_BLOCK, BlockManager
from asyncrl.rollout.kv_budget import bytes_per_position

PAGED_TOLERANCE = 1e-5


def test_blocks_are_shared_by_reference_and_cached_blocks_are_evicted_least_recently_used():
    manager = BlockManager(num_blocks=5, block_size=2)
    assert manager.available == 4  # block 0 is the zero block, never handed out
    a = manager.allocate(2)
    assert a is not None and NULL_BLOCK not in a
    key = manager.register(a[0], None, [1, 2], version=0)
    manager.register(a[1], key, [3, 4], version=0)
    hits, chain, oldest = manager.match([1, 2, 3, 4, 5], limit=4, version=0)
    assert hits == a and chain is not None and oldest == 0
    manager.take(hits)  # a second holder
    manager.release(a)
    manager.release(a)
    assert manager.cached == 2 and manager.available == 4
    b = manager.allocate(3)  # two free blocks, then the least recently used cached one
    assert b is not None and a[0] in b and a[1] not in b
    assert manager.match([1, 2, 3, 4], limit=4, version=0)[0] == []  # its first block is gone, so the chain is broken
    assert manager.allocate(2) is None


def test_a_match_stops_at_the_limit_a_changed_token_and_another_version():
    manager = BlockManager(num_blocks=8, block_size=2)
    blocks = manager.allocate(3)
    assert blocks is not None
    parent = None
    for block, tokens in zip(blocks, ([1, 2], [3, 4], [5, 6]), strict=True):
        parent = manager.register(block, parent, tokens, version=3)
    assert manager.match([1, 2, 3, 4, 5, 6], limit=5, version=3)[0] == blocks[:2]  # the last must be fed
    assert manager.match([1, 2, 9, 4, 5, 6], limit=6, version=3)[0] == blocks[:1]
    assert manager.match([1, 2, 3, 4], limit=4, version=4)[0] == []
    assert manager.match([1, 2, 3, 4], limit=4, version=None)[0] == blocks[:2]  # kv_on_push: keep
    manager.forget()
    assert manager.match([1, 2, 3, 4], limit=4, version=None)[0] == []


def test_a_prompts_partial_last_block_is_offered_while_held_and_withdrawn_when_released():
    manager = BlockManager(num_blocks=4, block_size=4)
    (block,) = manager.allocate(1) or ()
    manager.offer_tail(block, None, [7, 8, 9], version=2)
    assert manager.tail(None, [7, 8, 9], version=2) == (block, 2) and manager.tail(None, [7, 8, 9], version=None) == (block, 2)
    assert manager.tail(None, [7, 8], version=2) is None and manager.tail(None, [7, 8, 9], version=3) is None
    manager.release([block])  # its holder finished: the block may be handed out and overwritten
    assert manager.tail(None, [7, 8, 9], version=2) is None


@pytest.mark.parametrize("family", ["llama", "qwen3", "glm4_moe", "glm_moe_dsa"])
def test_paged_attention_gives_the_log_probs_of_one_block_per_request(family):
    """Blocks of 4, scattered by interleaved requests and shared by prefix reuse, against blocks as long as the
    model's context (each request one contiguous block: dense attention)."""
    model = make_tiny_model(family, eos_token_id=None) if family in ("qwen3", "glm_moe_dsa") else tiny_family_model(family)
    prompts = [[5, 17, 33, 9, 64, 2, 71], [40, 41, 42], list(range(20, 45)), [5, 17, 33, 9, 64, 2, 71, 8, 8]]
    params = [SamplingParams(temperature=1.0, max_tokens=10, seed=7 + i) for i in range(len(prompts))]
    results = {}
    for block in (4, 128):
        engine = EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=8, kv_block_size=block, max_model_len=128))
        results[block] = run_to_completion(engine, list(zip(prompts, params, strict=True)))
        engine.shutdown()
    assert results[4][3].cached_prompt_tokens == 4  # the first block of the first prompt
    for paged, dense in zip(results[4], results[128], strict=True):
        assert paged.token_ids == dense.token_ids
        assert max(abs(a - b) for a, b in zip(paged.logprobs, dense.logprobs, strict=True)) < PAGED_TOLERANCE


def test_preempted_requests_are_recomputed_and_sample_exactly_what_they_would_have():
    model = make_tiny_model("qwen3", eos_token_id=None, seed=3)
    prompts = [[3 + i, 9, 27, 81 % 120, 4, 4, 1 + i] for i in range(4)]
    params = [SamplingParams(temperature=1.0, max_tokens=40, seed=20 + i) for i in range(4)]
    roomy = EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=4, kv_block_size=4, max_model_len=64))
    alone = run_to_completion(roomy, list(zip(prompts, params, strict=True)))
    per_block = bytes_per_position(roomy.model.cache_layout(), torch.float32) * 4
    roomy.shutdown()
    # 20 blocks (one the zero block) hold 76 positions: one request's 47 fit, four at once do not.
    tight = EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=4, kv_block_size=4, kv_cache_memory=float(20 * per_block)))
    assert tight.cache.num_blocks == 20 and tight.max_model_len == 64
    squeezed = run_to_completion(tight, list(zip(prompts, params, strict=True)))
    assert tight.health()["preemptions"] > 0
    for mine, expected in zip(squeezed, alone, strict=True):
        assert mine.token_ids == expected.token_ids and mine.versions == expected.versions
        assert max(abs(a - b) for a, b in zip(mine.logprobs, expected.logprobs, strict=True)) < PAGED_TOLERANCE
    with pytest.raises(
        RequestError, match=r"max_model_len 64 \(rollout.max_model_len, or as many positions as rollout.kv_cache_memory holds\)"
    ):
        tight.make_request(list(range(3, 33)), SamplingParams(max_tokens=40), None)
    tight.shutdown()
