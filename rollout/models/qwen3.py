"""Native forward of transformers' dense `qwen3` (GQA attention with per-head q/k RMSNorm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from ..kv_cache import CacheLayout, ForwardBatch, KVCache
from .common import RopeTable, attend, attention_bias, last_tokens, rotate, swiglu, weight_getter


class Qwen3Model:
    def __init__(self, config, state_dict: dict, *, max_len: int, dtype: torch.dtype, device: torch.device):
        if config.hidden_act != "silu":
            raise ValueError(f"qwen3: only silu MLPs are supported, got {config.hidden_act!r}")
        if getattr(config, "use_sliding_window", False) or "sliding_attention" in (config.layer_types or []):
            raise ValueError("qwen3: sliding-window attention is not supported by the embedded engine")
        self.config = config
        self.dtype, self.device = dtype, device
        self.vocab_size = config.vocab_size
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.rope = RopeTable(Qwen3RotaryEmbedding(config), max_len, dtype=dtype, device=device)
        self.load_state_dict(state_dict)

    def cache_layout(self) -> CacheLayout:
        kv = (self.kv_heads, self.head_dim)
        return [{"k": kv, "v": kv} for _ in range(self.config.num_hidden_layers)]

    def load_state_dict(self, state_dict: dict) -> None:
        """Take transformers-named weights and fuse them (q/k/v into one matrix, gate/up into one)."""
        get = weight_getter(state_dict, dtype=self.dtype, device=self.device)
        bias = self.config.attention_bias
        layers = []
        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layers.append(
                dict(
                    ln1=get(p + "input_layernorm.weight"),
                    qkv=torch.cat([get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")]),
                    qkv_bias=torch.cat([get(a + f"{n}_proj.bias") for n in "qkv"]) if bias else None,
                    q_norm=get(a + "q_norm.weight"),
                    k_norm=get(a + "k_norm.weight"),
                    o=get(a + "o_proj.weight"),
                    o_bias=get(a + "o_proj.bias") if bias else None,
                    ln2=get(p + "post_attention_layernorm.weight"),
                    gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
                    down=get(p + "mlp.down_proj.weight"),
                )
            )
        embed = get("model.embed_tokens.weight")
        tied = self.config.tie_word_embeddings and "lm_head.weight" not in state_dict
        self.weights = dict(
            embed=embed, layers=layers, norm=get("model.norm.weight"), lm_head=embed if tied else get("lm_head.weight")
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Logits [B, vocab] at each row's last token; K/V of every real token go into the cache."""
        w, eps, hd = self.weights, self.eps, self.head_dim
        bsz, width = batch.tokens.shape
        cos, sin = self.rope.at(batch.positions)
        q_size, kv_size = self.heads * hd, self.kv_heads * hd
        h = F.embedding(batch.tokens, w["embed"])
        bias = attention_bias(batch.mask, self.kv_heads, self.heads // self.kv_heads, h.dtype)
        for i, lw in enumerate(w["layers"]):
            x = F.rms_norm(h, (h.shape[-1],), lw["ln1"], eps)
            q, k, v = F.linear(x, lw["qkv"], lw["qkv_bias"]).split([q_size, kv_size, kv_size], dim=-1)
            q = F.rms_norm(q.view(bsz, width, self.heads, hd), (hd,), lw["q_norm"], eps)
            k = F.rms_norm(k.view(bsz, width, self.kv_heads, hd), (hd,), lw["k_norm"], eps)
            q, k = rotate(q, cos, sin, interleaved=False), rotate(k, cos, sin, interleaved=False)
            cache.write(i, "k", batch, k)
            cache.write(i, "v", batch, v.view(bsz, width, self.kv_heads, hd))
            o = attend(q, cache.read(i, "k", batch), cache.read(i, "v", batch), bias, self.scale)
            h = h + F.linear(o, lw["o"], lw["o_bias"])
            h = h + swiglu(F.rms_norm(h, (h.shape[-1],), lw["ln2"], eps), lw["gate_up"], lw["down"])
        last = F.rms_norm(last_tokens(h, batch), (h.shape[-1],), w["norm"], eps)
        return F.linear(last, w["lm_head"])
