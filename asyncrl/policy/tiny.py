"""Build the embedded tiny policy from a `TinyModelConfig`: a transformers config and a fresh model.

The default is GLM-5's family (`glm_moe_dsa`: MLA attention, the DSA indexer, MoE with a sigmoid
router and a shared expert); `qwen3` is the dense fallback. Sizes come from the config so tests can
build even smaller models.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoModelForCausalLM, GlmMoeDsaConfig, PreTrainedConfig, PreTrainedModel, Qwen3Config

from asyncrl.configs.schema import TinyModelConfig

from .tokenizer import VOCAB_SIZE


def tiny_model_config(shape: TinyModelConfig, *, eos_token_id: int | None = 1, pad_token_id: int = 0) -> PreTrainedConfig:
    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    if shape.arch == "qwen3":
        return Qwen3Config(head_dim=shape.hidden_size // shape.num_heads, **common)
    return GlmMoeDsaConfig(
        moe_intermediate_size=shape.moe_intermediate_size,
        n_routed_experts=shape.num_experts,
        num_experts_per_tok=shape.experts_per_token,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        first_k_dense_replace=min(shape.first_dense_layers, shape.num_layers),
        kv_lora_rank=shape.kv_lora_rank,
        q_lora_rank=shape.q_lora_rank,
        qk_rope_head_dim=shape.qk_rope_head_dim,
        qk_nope_head_dim=shape.qk_nope_head_dim,
        v_head_dim=shape.v_head_dim,
        index_topk=shape.index_topk,
        index_n_heads=shape.index_heads,
        index_head_dim=shape.index_head_dim,
        **common,
    )


def build_tiny_model(shape: TinyModelConfig, seed: int = 0, dtype=None) -> PreTrainedModel:
    """A freshly initialised tiny causal LM, in float32 unless `dtype` says otherwise (float32 is the fast
    dtype on CPUs without bf16 units)."""
    import torch

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_model_config(shape), dtype=dtype or torch.float32)
    return model
