"""Pieces both native model families share: RoPE tables, rotations, cached attention, the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv_cache import ForwardBatch


class RopeTable:
    """cos/sin of every position up to max_len, computed exactly as transformers does (fp32)."""

    def __init__(self, rotary_embedding: torch.nn.Module, max_len: int, *, dtype: torch.dtype, device: torch.device):
        if getattr(rotary_embedding, "rope_type", "default") in ("dynamic", "longrope"):
            raise ValueError(f"RoPE type {rotary_embedding.rope_type!r} depends on sequence length; not supported")
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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [B, T, Hq, Dk] over cached k [B, Hkv, L, Dk], v [B, Hkv, L, Dv] -> [B, T, Hq * Dv].

    mask [B, T, L] says which cached positions each query sees (causal, and DSA's top-k where used).
    """
    batch, width, heads, _ = q.shape
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=k.shape[1] != heads
    )
    return out.transpose(1, 2).reshape(batch, width, heads * v.shape[-1])


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gate and up fused into one [2I, H] matrix."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


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
