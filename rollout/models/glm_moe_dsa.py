"""Native forward of transformers' `glm_moe_dsa` (GLM-5): MLA attention with interleaved RoPE, the DSA
indexer choosing each query's top-k key positions, and MoE layers (sigmoid router with
e_score_correction_bias, group-limited choice, one shared expert) after the first dense layers.
The same forward without the indexer is `deepseek_v3`'s (GLM-5's attention is DeepSeek-V3's MLA plus DSA).

Unlike transformers, which caches MLA latents and re-expands them for every past token at every
step, the cache holds expanded per-head K and V: decode then costs one projection per new token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRotaryEmbedding, yarn_apply_mscale

from asyncrl.policy.dsa import index_scores, selection_mask

from ..fp8 import linear
from ..kv_cache import CacheLayout, ForwardBatch, KVCache
from . import moe
from .common import NativeUnsupported, RopeTable, attend, attention_bias, last_tokens, native_weights, rotate, swiglu
from .moe import RouteRecorder, SigmoidMoE, mlp_weights

LATENT_NORM_EPS = 1e-6
"""transformers builds q_a_layernorm, kv_a_layernorm and the indexer's k_norm with this eps, not rms_norm_eps."""
LINEAR_KEYS = frozenset({"in_proj", "q_b", "kv_b", "o", "index_q"}) | moe.LINEAR_KEYS
"""Weight-dict entries that are matrices of a linear layer (what rollout.fp8 quantizes)."""


class GlmMoeDsaModel(RouteRecorder):
    linear_keys = LINEAR_KEYS

    def __init__(self, config, state_dict: dict, *, max_len: int, dtype: torch.dtype, device: torch.device, fp8: bool = False):
        family = config.model_type
        if config.hidden_act != "silu":
            raise NativeUnsupported(f"{family}: only silu MLPs run natively, got {config.hidden_act!r}")
        if not config.q_lora_rank:
            raise NativeUnsupported(f"{family}: q_lora_rank={config.q_lora_rank} (no query latent) does not run natively")
        self.config = config
        self.dtype, self.device, self.fp8 = dtype, device, fp8
        self.vocab_size = config.vocab_size
        self.heads = config.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.q_rank, self.kv_rank = config.q_lora_rank, config.kv_lora_rank
        dsa, layers = family == "glm_moe_dsa", config.num_hidden_layers
        self.index_heads: int = config.index_n_heads if dsa else 0
        self.index_dim: int = config.index_head_dim if dsa else 0
        self.index_topk: int = config.index_topk if dsa else 0
        self.moe = SigmoidMoE(config)
        self.top_k = self.moe.top_k
        self.scale = yarn_apply_mscale(config.rope_parameters, (self.nope + self.rope_dim) ** -0.5)
        self.interleaved = getattr(config, "rope_interleave", True)
        # One entry past the last layer: the MTP block (asyncrl.policy.mtp builds it like the last
        # layer, but with GLM-5 always with its own indexer).
        self.has_indexer = [kind == "full" for kind in config.indexer_types] + [True] if dsa else [False] * (layers + 1)
        if dsa and not self.has_indexer[0]:
            raise ValueError("glm_moe_dsa: the first layer must run its own indexer")
        self.is_moe = (
            [kind == "sparse" for kind in config.mlp_layer_types] if dsa else [i >= config.first_k_dense_replace for i in range(layers)]
        )
        self.is_moe.append(self.is_moe[-1])
        rotary = GlmMoeDsaRotaryEmbedding(config) if dsa else DeepseekV3RotaryEmbedding(config)
        self.rope = RopeTable(rotary, max_len, dtype=dtype, device=device)
        self.record_routes = False
        """Keep the experts every MoE layer chose in the last forward (`routes`), for routing replay."""
        self.routes: list[torch.Tensor] | None = None
        self.load_state_dict(state_dict)

    def cache_layout(self, extra_layers: int = 0) -> CacheLayout:
        """One entry per decoder layer, plus `extra_layers` more (the MTP layer, index N)."""
        kv = {"k": (self.heads, self.nope + self.rope_dim), "v": (self.heads, self.v_dim)}
        layers = self.has_indexer[: self.config.num_hidden_layers + extra_layers]
        return [dict(kv, index_k=(1, self.index_dim)) if full else dict(kv) for full in layers]

    # --- weights -------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """Take transformers-named weights and fuse what reads the same input into one matrix."""
        self.weights = native_weights(self, state_dict)  # swapped whole, after every tensor (and its quantization) is ready

    def layer_weights(self, get, i: int) -> dict:
        """Decoder layer i's weights; i = num_hidden_layers is the MTP block, named the same way."""
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        # Everything that reads the normed layer input is one matmul: q and kv latents, the
        # indexer's key and its per-head weights.
        in_proj = [get(a + "q_a_proj.weight"), get(a + "kv_a_proj_with_mqa.weight")]
        if self.has_indexer[i]:
            in_proj += [get(a + "indexer.wk.weight"), get(a + "indexer.weights_proj.weight")]
        in_bias = None
        if self.config.attention_bias:
            zeros = in_proj[2:]
            in_bias = torch.cat([get(a + "q_a_proj.bias"), get(a + "kv_a_proj_with_mqa.bias")] + [w.new_zeros(w.shape[0]) for w in zeros])
        w = dict(
            ln1=get(p + "input_layernorm.weight"),
            in_proj=torch.cat(in_proj),
            in_bias=in_bias,
            q_norm=get(a + "q_a_layernorm.weight"),
            q_b=get(a + "q_b_proj.weight"),
            kv_norm=get(a + "kv_a_layernorm.weight"),
            kv_b=get(a + "kv_b_proj.weight"),
            o=get(a + "o_proj.weight"),
            o_bias=get(a + "o_proj.bias") if self.config.attention_bias else None,
            ln2=get(p + "post_attention_layernorm.weight"),
        )
        if self.has_indexer[i]:
            w.update(
                index_q=get(a + "indexer.wq_b.weight"),
                index_norm_w=get(a + "indexer.k_norm.weight"),
                index_norm_b=get(a + "indexer.k_norm.bias"),
            )
        w.update(self.moe.weights(get, p + "mlp.") if self.is_moe[i] else mlp_weights(get, p + "mlp."))
        return w

    # --- forward -------------------------------------------------------------------------------

    def begin(self, batch: ForwardBatch) -> dict:
        """What every layer of one forward shares: RoPE at the batch's positions and the attention mask.

        `bias` is updated by each layer with its own indexer; "shared" indexer layers reuse it.
        """
        cos, sin = self.rope.at(batch.positions)
        causal = attention_bias(batch.mask, self.heads, 1, self.dtype)
        return dict(cos=cos, sin=sin, causal=causal, bias=causal)

    def layer(self, i: int, lw: dict, h: torch.Tensor, batch: ForwardBatch, cache: KVCache, ctx: dict) -> torch.Tensor:
        """One decoder layer over h [B, T, H]; its K/V (and indexer keys) go to cache layer i."""
        hidden, eps = self.config.hidden_size, self.config.rms_norm_eps
        x = F.rms_norm(h, (hidden,), lw["ln1"], eps)
        o, ctx["bias"] = self._attention(i, lw, x, batch, cache, ctx["cos"], ctx["sin"], ctx["causal"], ctx["bias"])
        h = h + o
        x = F.rms_norm(h, (hidden,), lw["ln2"], eps)
        if not self.is_moe[i]:
            return h + swiglu(x, lw["gate_up"], lw["down"])
        out, chosen = self.moe(lw, x)
        if i < self.config.num_hidden_layers:  # the MTP block's routes are not the policy's
            self.keep(chosen)
        return h + out

    def _trunk(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        ctx = self.begin(batch)
        self.start_recording()
        h = F.embedding(batch.tokens, self.weights["embed"])
        for i, lw in enumerate(self.weights["layers"]):
            h = self.layer(i, lw, h, batch, cache, ctx)
        return h

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Final normed hidden states [B, T, H] at every position; K/V of real tokens go into the cache."""
        h = self._trunk(batch, cache)
        return F.rms_norm(h, (self.config.hidden_size,), self.weights["norm"], self.config.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weights["lm_head"])

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Logits [B, vocab] at each row's last token; K/V and indexer keys of real tokens go into the cache."""
        h = self._trunk(batch, cache)
        last = F.rms_norm(last_tokens(h, batch), (self.config.hidden_size,), self.weights["norm"], self.config.rms_norm_eps)
        return self.logits(last)

    def _attention(self, i, lw, x, batch: ForwardBatch, cache: KVCache, cos, sin, causal, bias):
        bsz, width, _ = x.shape
        heads, nope, rope = self.heads, self.nope, self.rope_dim
        splits = [self.q_rank, self.kv_rank, rope] + ([self.index_dim, self.index_heads] if self.has_indexer[i] else [])
        parts = linear(x, lw["in_proj"], lw["in_bias"]).split(splits, dim=-1)
        q_latent, kv_latent, k_rot = parts[:3]

        q_resid = F.rms_norm(q_latent, (self.q_rank,), lw["q_norm"], LATENT_NORM_EPS)
        q = linear(q_resid, lw["q_b"]).view(bsz, width, heads, nope + rope)
        q = torch.cat((q[..., :nope], rotate(q[..., nope:], cos, sin, interleaved=self.interleaved)), dim=-1)

        kv = linear(F.rms_norm(kv_latent, (self.kv_rank,), lw["kv_norm"], LATENT_NORM_EPS), lw["kv_b"])
        k_nope, v = kv.view(bsz, width, heads, nope + self.v_dim).split([nope, self.v_dim], dim=-1)
        k_rot = rotate(k_rot.unsqueeze(2), cos, sin, interleaved=self.interleaved).expand(-1, -1, heads, -1)
        cache.write(i, "k", batch, torch.cat((k_nope, k_rot), dim=-1))
        cache.write(i, "v", batch, v)

        if self.has_indexer[i]:
            index_k, index_weights = parts[3:]
            selected = self._select(i, lw, q_resid, index_k, index_weights, batch, cache, cos, sin)
            bias = causal if selected is None else attention_bias(selected, self.heads, 1, x.dtype)
        o = attend(q, cache.read(i, "k", batch), cache.read(i, "v", batch), bias, self.scale)
        return linear(o, lw["o"], lw["o_bias"]), bias

    def _select(self, i, lw, q_resid, index_k, index_weights, batch: ForwardBatch, cache: KVCache, cos, sin):
        """DSA: each query sees at most index_topk cached positions, those its indexer scores highest.

        Returns the visibility mask [B, T, L], or None when it is plain causal.
        """
        rope = self.rope_dim
        k = F.layer_norm(index_k, (self.index_dim,), lw["index_norm_w"], lw["index_norm_b"], LATENT_NORM_EPS)
        k = torch.cat((rotate(k[..., :rope], cos[:, :, 0], sin[:, :, 0], interleaved=True), k[..., rope:]), dim=-1)
        cache.write(i, "index_k", batch, k.unsqueeze(2))
        if batch.context_len <= self.index_topk:
            return None  # no query has more than top-k visible positions: all are kept
        bsz, width, _ = q_resid.shape
        q = linear(q_resid, lw["index_q"]).view(bsz, width, self.index_heads, self.index_dim)
        q = torch.cat((rotate(q[..., :rope], cos, sin, interleaved=True), q[..., rope:]), dim=-1)
        keys = cache.read(i, "index_k", batch)[:, 0]  # [B, L, D]
        # The learner selects through the same two functions (asyncrl.policy.dsa), ties included.
        scores = index_scores(q, keys, index_weights * self.index_heads**-0.5, batch.mask)
        return selection_mask(scores, self.index_topk, batch.mask)
