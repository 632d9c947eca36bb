"""DSA top-k: the one scoring and selection of key positions that the embedded engine and the learner share.

GLM-5's indexer scores every visible key position per query and attention then sees only the
`index_topk` best. Scores tie exactly and often: a position where every head's ReLU is at zero
scores 0, so beyond the positive ones the choice is among equals. `torch.topk` leaves the order of
equal values unspecified (it differs between CPU and CUDA kernels and with the tensor's length), so
two code paths that compute the very same scores could still attend to different positions. Here
the order is explicit: score descending, then position ascending (a stable sort), with -0.0 made
+0.0 first so that radix sorts, which tell the two zeros apart, agree with comparison sorts.

`indexer_forward` is transformers' `GlmMoeDsaIndexer.forward` with the shared scoring and selection;
`asyncrl.policy.routing.use_shared_selection` installs it on the learner's modules. `indexer_scores`
is the same arithmetic with gradients, for the indexer's warm-up (learner/indexer_warmup.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Indexer scores [B, T, L] (float32, -inf where not visible).

    q [B, T, H, D]: the rotated indexer queries; keys [B, L, D]: the rotated, normed indexer keys;
    weights [B, T, H]: per-head weights, already scaled by H^-0.5; visible [B, T, L] bool.
    score[b, t, l] = sum_h weights[b, t, h] * relu(q[b, t, h] . keys[b, l] / sqrt(D)).
    """
    per_head = F.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1)) * q.shape[-1] ** -0.5)
    scores = torch.matmul(weights.float().unsqueeze(-2), per_head).squeeze(-2)
    return scores.masked_fill(~visible, float("-inf"))


def topk_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., min(k, L)] of the k best scores along the last axis: score descending, then
    position ascending. -inf (hidden) positions come last, so they are only chosen when fewer than
    k are visible."""
    canonical = scores + 0.0  # -0.0 + 0.0 is +0.0: the two zeros are one value for every sort kernel
    return canonical.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def selection_mask(scores: torch.Tensor, k: int, visible: torch.Tensor) -> torch.Tensor:
    """[B, T, L] bool: the positions each query attends to, its top-k visible ones."""
    chosen = topk_positions(scores, k)
    return torch.zeros_like(visible).scatter_(-1, chosen, True) & visible


def indexer_query_key(indexer, hidden_states, q_resid, position_embeddings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The indexer's rotated queries [B, T, H, D], rotated normed keys [B, T, D] and head weights [B, T, H]
    (scaled by H^-0.5) of a transformers `GlmMoeDsaIndexer`: its own forward's arithmetic, with gradients."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    batch, length, _ = hidden_states.shape
    rope = indexer.qk_rope_head_dim
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(batch, length, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = q.split([rope, indexer.head_dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = k.split([rope, indexer.head_dim - rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float() * indexer.n_heads**-0.5
    return q, k, weights


def visible_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """The bool [B, T, L] mask of the keys each query may see, from the mask transformers hands the
    indexer: a bool one (sdpa) or an additive one (eager: 0 where visible)."""
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0


def indexer_scores(indexer, hidden_states, q_resid, position_embeddings, attention_mask) -> torch.Tensor:
    """`index_scores` [B, T, T] of a transformers indexer over a whole sequence (no cache), with gradients
    into its parameters: what the DSA warm-up trains (learner/indexer_warmup.py)."""
    q, k, weights = indexer_query_key(indexer, hidden_states, q_resid, position_embeddings)
    visible = visible_positions(attention_mask).expand(q.shape[0], q.shape[1], k.shape[1])
    return index_scores(q, k, weights, visible)


@torch.no_grad()
def indexer_forward(indexer, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None):
    """`GlmMoeDsaIndexer.forward` (transformers) through `index_scores` and `topk_positions`.

    Returns the int32 top-k indices [B, S, min(index_topk, T)] as the original does. Under no_grad,
    as in transformers: the selection is discrete, so no gradient reaches the indexer from the loss
    (the indexer learns from its own KL loss in the warm-up, learner/indexer_warmup.py).
    """
    q, k, weights = indexer_query_key(indexer, hidden_states, q_resid, position_embeddings)
    if cache is not None:
        k = cache.update_indexer(k, indexer.layer_idx)
    visible = visible_positions(attention_mask).expand(q.shape[0], q.shape[1], k.shape[1])
    scores = index_scores(q, k, weights, visible)
    return topk_positions(scores, indexer.index_topk).to(torch.int32)
