"""The embedded engine's paged KV cache within `rollout.kv_cache_memory`: as many blocks as fit, the engine's
length cut to them when max_model_len is unset, refused with the numbers and the settings when it is set and
does not fit."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_tiny_model

from asyncrl.configs.schema import EmbeddedRolloutConfig
from asyncrl.records import SamplingParams
from asyncrl.rollout.engine import EmbeddedEngine
from asyncrl.rollout.intake import RequestError
from asyncrl.rollout.kv_budget import available_memory, budget_bytes, bytes_per_position, plan_blocks

LAYOUT = [{"k": (3, 64), "v": (3, 64)}] * 30  # SmolLM2-135M: 30 layers, 3 KV heads of 64


def test_smollm2s_own_context_is_cut_to_the_blocks_the_budget_holds(caplog):
    assert bytes_per_position(LAYOUT, torch.float32) == 46_080
    with caplog.at_level(logging.INFO):
        blocks, max_len = plan_blocks(
            LAYOUT, block_size=16, max_num_seqs=64, model_len=8192, dtype=torch.float32, budget=6 * 10**9, explicit=False
        )
    assert blocks == 6 * 10**9 // (16 * 46_080) == 8138 and max_len == 8192  # 130k positions: one request of 8k fits
    assert "8138 blocks of 16 positions (130192 tokens" in caplog.text
    blocks, max_len = plan_blocks(
        LAYOUT, block_size=16, max_num_seqs=64, model_len=512, dtype=torch.float32, budget=6 * 10**9, explicit=True
    )
    assert blocks == 2 * 64 * 32 + 1 and max_len == 512  # no more than twice what 64 requests of 512 positions need
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        blocks, max_len = plan_blocks(
            LAYOUT, block_size=16, max_num_seqs=64, model_len=8192, dtype=torch.bfloat16, budget=10**8, explicit=False
        )
    assert (blocks, max_len) == (271, 4320) and "fewer than the model's 8192: max_model_len is 4320" in caplog.text


def test_a_set_max_model_len_that_does_not_fit_and_a_budget_too_small_are_refused_naming_the_settings():
    with pytest.raises(
        ValueError, match=r"rollout.max_model_len=8192 does not fit: rollout.kv_cache_memory's 0.10 GB holds 2144 positions"
    ):
        plan_blocks(LAYOUT, block_size=16, max_num_seqs=64, model_len=8192, dtype=torch.float32, budget=10**8, explicit=True)
    with pytest.raises(ValueError, match=r"holds 48 positions \(46.1 KB each\), fewer than 64: raise rollout\.kv_cache_memory"):
        plan_blocks(LAYOUT, block_size=16, max_num_seqs=64, model_len=8192, dtype=torch.float32, budget=3 * 10**6, explicit=False)


def test_the_budget_is_a_fraction_of_available_memory_up_to_1_and_bytes_above(monkeypatch):
    from asyncrl.rollout import kv_budget

    assert available_memory(torch.device("cpu")) > 0
    monkeypatch.setattr(kv_budget, "available_memory", lambda device: 8 * 10**9)
    assert budget_bytes(0.25, torch.device("cpu")) == 2 * 10**9 and budget_bytes(1.0, torch.device("cpu")) == 8 * 10**9
    assert budget_bytes(3e9, torch.device("cpu")) == 3 * 10**9


def test_the_engine_sizes_its_cache_to_the_budget_and_refuses_a_request_past_it():
    model = make_tiny_model("qwen3", max_position_embeddings=512)
    config = EmbeddedRolloutConfig(device="cpu", max_num_seqs=4, kv_cache_memory=2.0)
    layout_engine = EmbeddedEngine(model, config.model_copy(update={"max_model_len": 64, "kv_cache_memory": 1e9}))
    per_position = bytes_per_position(layout_engine.model.cache_layout(), torch.float32)
    assert layout_engine.cache.num_blocks == 2 * 4 * 4 + 1  # twice four requests of 64 positions, and the zero block
    layout_engine.shutdown()
    engine = EmbeddedEngine(model, config.model_copy(update={"kv_cache_memory": float(8 * 16 * per_position)}))
    try:
        assert engine.cache.num_blocks == 8 and engine.max_model_len == 112 and engine.cache.max_len == 112
        assert engine.cache.layers[0]["k"].shape[1] == 8 * 16
        with pytest.raises(RequestError, match=r"exceeds the engine's max_model_len 112 \(rollout.max_model_len, or as many positions"):
            engine.make_request(list(range(100)), SamplingParams(max_tokens=16), None)
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match=r"rollout\.max_model_len=512 does not fit"):
        EmbeddedEngine(model, config.model_copy(update={"max_model_len": 512, "kv_cache_memory": float(8 * 16 * per_position)}))
