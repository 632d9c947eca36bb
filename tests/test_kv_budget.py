"""The embedded engine's KV cache within `rollout.kv_cache_memory`: as long as fits when max_model_len is
unset, refused with the numbers and the settings when it is set and does not fit."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_tiny_model

from asyncrl.configs.schema import EmbeddedRolloutConfig
from asyncrl.records import SamplingParams
from asyncrl.rollout.engine import EmbeddedEngine
from asyncrl.rollout.intake import RequestError
from asyncrl.rollout.kv_budget import available_memory, budget_bytes, bytes_per_position, fit_max_len

LAYOUT = [{"k": (3, 64), "v": (3, 64)}] * 30  # SmolLM2-135M: 30 layers, 3 KV heads of 64


def test_smollm2s_own_context_would_take_48_gb_and_is_cut_to_the_budget(caplog):
    assert bytes_per_position(LAYOUT, torch.float32) == 46_080
    assert 128 * 8192 * 46_080 > 48e9
    with caplog.at_level(logging.WARNING):
        granted = fit_max_len(LAYOUT, 128, 8192, dtype=torch.float32, budget=6 * 10**9, explicit=False)
    assert granted == 1008 and granted % 16 == 0 and 128 * granted * 46_080 <= 6e9
    assert "128 slots x 1008 positions" in caplog.text and "the model supports 8192" in caplog.text
    assert fit_max_len(LAYOUT, 128, 512, dtype=torch.float32, budget=6 * 10**9, explicit=True) == 512
    assert fit_max_len(LAYOUT, 128, 512, dtype=torch.bfloat16, budget=10**9, explicit=False) == 336


def test_a_set_max_model_len_that_does_not_fit_and_a_budget_too_small_are_refused_naming_the_settings():
    with pytest.raises(
        ValueError, match=r"need 48.32 GB of KV cache \(rollout.max_model_len=8192\), above rollout.kv_cache_memory's 6.00 GB"
    ):
        fit_max_len(LAYOUT, 128, 8192, dtype=torch.float32, budget=6 * 10**9, explicit=True)
    with pytest.raises(ValueError, match=r"lower rollout\.max_num_seqs or rollout\.retained_prefixes, or raise rollout\.kv_cache_memory"):
        fit_max_len(LAYOUT, 128, 8192, dtype=torch.float32, budget=10**8, explicit=False)


def test_the_budget_is_a_fraction_of_available_memory_up_to_1_and_bytes_above(monkeypatch):
    from asyncrl.rollout import kv_budget

    assert available_memory(torch.device("cpu")) > 0
    monkeypatch.setattr(kv_budget, "available_memory", lambda device: 8 * 10**9)
    assert budget_bytes(0.25, torch.device("cpu")) == 2 * 10**9 and budget_bytes(1.0, torch.device("cpu")) == 8 * 10**9
    assert budget_bytes(3e9, torch.device("cpu")) == 3 * 10**9


def test_the_engine_sizes_its_cache_to_the_budget_and_refuses_a_request_past_it():
    model = make_tiny_model("qwen3", max_position_embeddings=512)
    config = EmbeddedRolloutConfig(device="cpu", max_num_seqs=4, retained_prefixes=0, kv_cache_memory=2.0)
    layout_engine = EmbeddedEngine(model, config.model_copy(update={"max_model_len": 64, "kv_cache_memory": 1e9}))
    per_position = bytes_per_position(layout_engine.model.cache_layout(), torch.float32)
    layout_engine.shutdown()
    engine = EmbeddedEngine(model, config.model_copy(update={"kv_cache_memory": float(4 * 100 * per_position)}))
    try:
        assert engine.max_model_len == 96 and engine.cache.max_len == 96
        assert engine.cache.layers[0]["k"].shape[2] == 96
        with pytest.raises(RequestError, match=r"exceeds the engine's max_model_len 96 \(rollout.max_model_len, or as many positions"):
            engine.make_request(list(range(90)), SamplingParams(max_tokens=8), None)
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match=r"rollout\.max_model_len=512"):
        EmbeddedEngine(model, config.model_copy(update={"max_model_len": 512, "kv_cache_memory": float(4 * 100 * per_position)}))
