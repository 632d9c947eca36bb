"""Pieces both native model families share: RoPE tables, rotations, cached attention, the MLP."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ..fp8 import linear, quantize_weights
from ..kv_cache import ForwardBatch


class NativeUnsupported(ValueError):
    """A variant of a family the native forward does not implement; the engine runs it on the generic path."""


class RotaryEmbedding(Protocol):
    """What `RopeTable` reads of a transformers rotary embedding module (it may also have a `rope_type`)."""

    @property
    def inv_freq(self) -> torch.Tensor: ...

    @property
    def attention_scaling(self) -> float: ...


class RopeTable:
    """cos/sin of every position up to max_len, computed exactly as transformers does (fp32)."""

    def __init__(self, rotary_embedding: RotaryEmbedding, max_len: int, *, dtype: torch.dtype, device: torch.device):
        rope_type = getattr(rotary_embedding, "rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(f"RoPE type {rope_type!r} depends on sequence length; not supported")
        inv_freq = rotary_embedding.inv_freq.float().to(device)
        scaling = rotary_embedding.attention_scaling
        freqs = torch.arange(max_len, device=device).float()[:, None] * inv_freq[None, :]
        self.cos = (freqs.cos() * scaling).to(dtype)
        self.sin = (freqs.sin() * scaling).to(dtype)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [B, T]: [B, T, 1, rotary_dim / 2], broadcast over heads."""
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """Apply RoPE to x [..., rotary_dim]. Interleaved (GLM/DeepSeek) pairs (x0, x1), (x2, x3), ...

    and returns them de-interleaved, as transformers does; otherwise pairs are (x_i, x_{i+d/2}).
    """
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention_bias(mask: torch.Tensor, kv_heads: int, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [kv_heads * B, groups * T, L] (0 visible, -inf hidden) from mask [B, T, L], head-major as
    `attend` batches."""
    batch, width, length = mask.shape
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias[None, :, None].expand(kv_heads, batch, groups, width, length).reshape(kv_heads * batch, groups * width, length)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [B, T, Hq, Dk] over cached k [B, Hkv, L, Dk], v [B, Hkv, L, Dv] -> [B, T, Hq * Dv].

    `bias` comes from `attention_bias`. Query heads sharing a KV head (GQA) are stacked along the
    query axis, so one batched matmul per step serves every head without repeating K or V; the
    mask and scale fold into that matmul (baddbmm), which on CPU beats SDPA at these sizes. The
    batch runs head-major (kv head, row): the paged cache's reads (`KVCache.read`) are gathered in
    that order, so K and V reach the matmuls as they are, without another copy.
    """
    batch, width, heads, dk = q.shape
    kv_heads, length, dv = k.shape[1], k.shape[2], v.shape[-1]
    groups = heads // kv_heads
    q = q.view(batch, width, kv_heads, groups, dk).permute(2, 0, 3, 1, 4).reshape(kv_heads * batch, groups * width, dk)
    keys = k.transpose(0, 1).reshape(kv_heads * batch, length, dk)
    scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale)
    out = torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1).reshape(kv_heads * batch, length, dv))
    return out.view(kv_heads, batch, groups, width, dv).permute(1, 3, 0, 2, 4).reshape(batch, width, heads * dv)


def swiglu(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gate and up fused into one [2I, H] matrix."""
    gate, up = linear(x, gate_up, gate_up_bias).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down, down_bias)


def check_full_attention(config, max_len: int) -> None:
    """Refuse a config whose layers do not all attend to the whole context up to max_len: the engine's cache
    and mask are full attention."""
    family, window = config.model_type, getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"]) - {"full_attention", "sliding_attention"}
    if kinds:
        raise ValueError(
            f"{family}: layers of kinds {sorted(kinds)}; the embedded engine runs attention layers only (use rollout.type='vllm')"
        )
    if getattr(config, "use_sliding_window", True) and window is not None and window < max_len:
        raise ValueError(
            f"{family}: sliding_window={window}, below the engine's context ({max_len}); the embedded engine attends to the "
            "whole context (set rollout.max_model_len to the window, or use rollout.type='vllm')"
        )


def last_tokens(hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Each row's hidden state at its last real token: [B, H]."""
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), batch.last_index]


def weight_getter(state_dict: dict, *, dtype: torch.dtype, device: torch.device):
    """A function name -> tensor on the engine's device and dtype, failing clearly on missing keys."""

    def get(name: str) -> torch.Tensor:
        if name not in state_dict:
            raise KeyError(f"state dict lacks {name!r}")
        return state_dict[name].detach().to(device=device, dtype=dtype)

    return get


def native_weights(model, state_dict: dict) -> dict:
    """A native model's whole weight dict from transformers-named weights: embedding, each decoder layer's
    (`model.layer_weights`), final norm and LM head (the embedding where tied), linear weights in FP8
    when `model.fp8`. Built whole before the caller swaps it in: a load is all or nothing."""
    get = weight_getter(state_dict, dtype=model.dtype, device=model.device)
    layers = [model.layer_weights(get, i) for i in range(model.config.num_hidden_layers)]
    embed = get("model.embed_tokens.weight")
    tied = model.config.tie_word_embeddings and "lm_head.weight" not in state_dict
    weights = dict(embed=embed, layers=layers, norm=get("model.norm.weight"), lm_head=embed if tied else get("lm_head.weight"))
    if model.fp8:
        quantize_weights(weights, model.linear_keys)
    return weights
