"""Native forward of the GQA-attention families: `llama`, `qwen2`, `mistral`, `qwen3` and `glm4_moe` (GLM-4.5).

One decoder layer shape serves them all (RMSNorm, rotary GQA attention, a SwiGLU MLP or a sigmoid-routed
MoE); what differs is read from the config and the weights: the per-head q/k RMSNorm (qwen3; glm4_moe's
`use_qk_norm`), the attention and MLP biases (qwen2 biases q/k/v; glm4_moe's `attention_bias` q/k/v;
llama's all four projections, and `mlp_bias` the MLP), partial rotary embeddings (glm4_moe rotates the
first half of each head), GLM-4.5's MoE layers after `first_k_dense_replace` dense ones (`moe.py`), and
each family's own rotary embedding (llama3 / linear / yarn scaling come with it).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from ..fp8 import linear
from ..kv_cache import CacheLayout, ForwardBatch, KVCache
from . import moe
from .common import (
    NativeUnsupported,
    RopeTable,
    attend,
    attention_bias,
    check_full_attention,
    last_tokens,
    native_weights,
    rotate,
    swiglu,
)
from .moe import RouteRecorder, SigmoidMoE

LINEAR_KEYS = frozenset({"qkv", "o"}) | moe.LINEAR_KEYS
"""Weight-dict entries that are matrices of a linear layer (what rollout.fp8 quantizes)."""
ROTARY = {
    "llama": "LlamaRotaryEmbedding",
    "qwen2": "Qwen2RotaryEmbedding",
    "mistral": "MistralRotaryEmbedding",
    "qwen3": "Qwen3RotaryEmbedding",
    "glm4_moe": "Glm4MoeRotaryEmbedding",
}
"""model_type -> the family's rotary embedding class in transformers (its RoPE scaling included)."""


def _rotary(config):
    family = config.model_type
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return getattr(module, ROTARY[family])(config)


class GqaModel(RouteRecorder):
    linear_keys = LINEAR_KEYS

    def __init__(self, config, state_dict: dict, *, max_len: int, dtype: torch.dtype, device: torch.device, fp8: bool = False):
        family = config.model_type
        if config.hidden_act != "silu":
            raise NativeUnsupported(f"{family}: only silu MLPs run natively, got {config.hidden_act!r}")
        if getattr(config, "pretraining_tp", 1) != 1:
            raise NativeUnsupported(f"{family}: pretraining_tp={config.pretraining_tp} does not run natively")
        check_full_attention(config, max_len)
        glm = family == "glm4_moe"
        self.qk_norm = family == "qwen3" or (glm and config.use_qk_norm)
        self.config = config
        self.dtype, self.device, self.fp8 = dtype, device, fp8
        self.vocab_size = config.vocab_size
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.rope = RopeTable(_rotary(config), max_len, dtype=dtype, device=device)
        self.rotary_dim = 2 * self.rope.cos.shape[-1]
        """The leading dimensions of each head that RoPE rotates (all of them but for a partial rotary factor)."""
        layers = config.num_hidden_layers
        self.is_moe = [glm and i >= config.first_k_dense_replace for i in range(layers)]
        self.is_moe.append(self.is_moe[-1])  # the MTP block, index N, is built like the last layer
        self.moe = SigmoidMoE(config) if any(self.is_moe) else None
        if self.moe is not None:
            self.top_k = self.moe.top_k
            self.record_routes = False
            """Keep the experts every MoE layer chose in the last forward (`routes`), for routing replay."""
            self.routes: list[torch.Tensor] | None = None
        self.load_state_dict(state_dict)

    def cache_layout(self, extra_layers: int = 0) -> CacheLayout:
        """One entry per decoder layer, plus `extra_layers` more of the same shape (the MTP layer)."""
        kv = (self.kv_heads, self.head_dim)
        return [{"k": kv, "v": kv} for _ in range(self.config.num_hidden_layers + extra_layers)]

    def load_state_dict(self, state_dict: dict) -> None:
        """Take transformers-named weights and fuse them (q/k/v into one matrix, gate/up into one)."""
        self.weights = native_weights(self, state_dict)  # swapped whole, after every tensor (and its quantization) is ready

    def layer_weights(self, get, i: int) -> dict:
        """Decoder layer i's weights; i = num_hidden_layers is the MTP block, named the same way."""
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        # Biases are where the family's layers have them; the config says which (qwen2: q/k/v always).
        family = self.config.model_type
        qkv_bias = family == "qwen2" or getattr(self.config, "attention_bias", False)
        o_bias = family != "glm4_moe" and getattr(self.config, "attention_bias", False)
        mlp_bias = getattr(self.config, "mlp_bias", False)
        if self.is_moe[i]:
            assert self.moe is not None
            mlp = self.moe.weights(get, m)
        else:
            mlp = dict(
                gate_up=torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]),
                gate_up_bias=torch.cat([get(m + "gate_proj.bias"), get(m + "up_proj.bias")]) if mlp_bias else None,
                down=get(m + "down_proj.weight"),
                down_bias=get(m + "down_proj.bias") if mlp_bias else None,
            )
        return dict(
            ln1=get(p + "input_layernorm.weight"),
            qkv=torch.cat([get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")]),
            qkv_bias=torch.cat([get(a + f"{n}_proj.bias") for n in "qkv"]) if qkv_bias else None,
            q_norm=get(a + "q_norm.weight") if self.qk_norm else None,
            k_norm=get(a + "k_norm.weight") if self.qk_norm else None,
            o=get(a + "o_proj.weight"),
            o_bias=get(a + "o_proj.bias") if o_bias else None,
            ln2=get(p + "post_attention_layernorm.weight"),
            **mlp,
        )

    def begin(self, batch: ForwardBatch) -> dict:
        """What every layer of one forward shares: RoPE at the batch's positions and the attention mask."""
        cos, sin = self.rope.at(batch.positions)
        return dict(cos=cos, sin=sin, bias=attention_bias(batch.mask, self.kv_heads, self.heads // self.kv_heads, self.dtype))

    def layer(self, i: int, lw: dict, h: torch.Tensor, batch: ForwardBatch, cache: KVCache, ctx: dict) -> torch.Tensor:
        """One decoder layer over h [B, T, H]; its K/V go to cache layer i."""
        eps, hd = self.eps, self.head_dim
        bsz, width, _ = h.shape
        q_size, kv_size = self.heads * hd, self.kv_heads * hd
        x = F.rms_norm(h, (h.shape[-1],), lw["ln1"], eps)
        q, k, v = linear(x, lw["qkv"], lw["qkv_bias"]).split([q_size, kv_size, kv_size], dim=-1)
        q, k = q.view(bsz, width, self.heads, hd), k.view(bsz, width, self.kv_heads, hd)
        if self.qk_norm:
            q, k = F.rms_norm(q, (hd,), lw["q_norm"], eps), F.rms_norm(k, (hd,), lw["k_norm"], eps)
        q, k = self._rotate(q, ctx), self._rotate(k, ctx)
        cache.write(i, "k", batch, k)
        cache.write(i, "v", batch, v.view(bsz, width, self.kv_heads, hd))
        o = attend(q, cache.read(i, "k", batch), cache.read(i, "v", batch), ctx["bias"], self.scale)
        h = h + linear(o, lw["o"], lw["o_bias"])
        x = F.rms_norm(h, (h.shape[-1],), lw["ln2"], eps)
        if not self.is_moe[i]:
            return h + swiglu(x, lw["gate_up"], lw["down"], lw["gate_up_bias"], lw["down_bias"])
        assert self.moe is not None
        out, chosen = self.moe(lw, x)
        if i < self.config.num_hidden_layers:  # the MTP block's routes are not the policy's
            self.keep(chosen)
        return h + out

    def _rotate(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return rotate(x, ctx["cos"], ctx["sin"], interleaved=False)
        part = self.rotary_dim
        return torch.cat((rotate(x[..., :part], ctx["cos"], ctx["sin"], interleaved=False), x[..., part:]), dim=-1)

    def _trunk(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        w = self.weights
        ctx = self.begin(batch)
        if self.moe is not None:
            self.start_recording()
        h = F.embedding(batch.tokens, w["embed"])
        for i, lw in enumerate(w["layers"]):
            h = self.layer(i, lw, h, batch, cache, ctx)
        return h

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Final normed hidden states [B, T, H] at every position; K/V of every real token go into the cache."""
        h = self._trunk(batch, cache)
        return F.rms_norm(h, (h.shape[-1],), self.weights["norm"], self.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weights["lm_head"])

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Logits [B, vocab] at each row's last token; K/V of every real token go into the cache."""
        h = self._trunk(batch, cache)
        return self.logits(F.rms_norm(last_tokens(h, batch), (h.shape[-1],), self.weights["norm"], self.eps))
