"""Tiny random checkpoints of real model families, built from transformers configs (no download).

`tiny_family_model(family)` gives a transformers causal LM of that family with unit-scale random
weights (as `conftest.make_tiny_model` draws them, so wrong attention or routing shows in the
numbers); `save_family_checkpoint(family, directory)` writes it as a Hugging Face directory with a
byte-level BPE tokenizer trained locally and the chat template of the family's checkpoints
(`chat_templates.py`), the directory a user would point `policy.path` at.
"""

from __future__ import annotations

from pathlib import Path

import torch
from chat_templates import build as build_tokenizer
from conftest import unit_scale_
from transformers import AutoModelForCausalLM, PreTrainedModel

VOCAB_SIZE = 640
"""Above the test tokenizers' 600 learned tokens plus their added ones."""
DENSE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
MOE = dict(
    moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
    first_k_dense_replace=1, routed_scaling_factor=1.0,
)  # fmt: skip
FAMILIES: dict[str, tuple[str, dict]] = {
    # family: (the chat template its checkpoints bring, config fields beyond the shared ones)
    "llama": ("llama3", dict(DENSE, head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "qwen2": ("qwen3", dict(DENSE)),
    "mistral": ("qwen3", dict(DENSE, sliding_window=None)),
    "glm4_moe": ("glm45", dict(DENSE, **MOE, partial_rotary_factor=0.5, head_dim=16, use_qk_norm=True)),
    "deepseek_v3": (
        "qwen3",
        dict(DENSE, **MOE, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    ),
    "gpt2": ("qwen3", dict(n_embd=32, n_layer=2, n_head=4, n_positions=256)),
    "phi": ("qwen3", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, partial_rotary_factor=0.5)),
}
NATIVE = {"llama": "GqaModel", "qwen2": "GqaModel", "mistral": "GqaModel", "deepseek_v3": "GlmMoeDsaModel", "glm4_moe": "GqaModel"}
"""Families the embedded engine runs natively (besides the project's own glm_moe_dsa and qwen3), and the class that does."""


def tiny_family_model(
    family: str, *, eos_token_id: int | None = None, pad_token_id: int = 0, seed: int = 0, **overrides
) -> PreTrainedModel:
    """`overrides`: config fields beyond the family's defaults here (a variant, e.g. hidden_act)."""
    from transformers import AutoConfig

    _, fields = FAMILIES[family]
    config = AutoConfig.for_model(
        family, vocab_size=VOCAB_SIZE, max_position_embeddings=256, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        bos_token_id=None, tie_word_embeddings=family == "gpt2", **{**fields, **overrides},
    )  # fmt: skip
    torch.manual_seed(seed)
    return unit_scale_(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())


def save_family_checkpoint(family: str, directory: Path, *, seed: int = 0) -> Path:
    """A checkpoint directory of `family`: the tiny model, its family's tokenizer and chat template."""
    template, _ = FAMILIES[family]
    tokenizer = build_tokenizer(template)
    model = tiny_family_model(family, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=seed)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory
