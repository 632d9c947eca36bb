"""The multi-token-prediction (MTP) layer in the GLM-5 / DeepSeek-V3 shape, trained beside the policy.

One parameter set, applied recurrently: at depth k, position i combines the previous depth's hidden
state h^{k-1}_i (depth 0: the policy's final, normed hidden state, which is what vLLM hands its MTP
drafter) with the embedding of token t_{i+k}, and predicts token t_{i+k+1}:

    h^k_i = block(eh_proj([enorm(embed(t_{i+k})), hnorm(h^{k-1}_i)]))     # embedding first, as in
    logits = lm_head(shared_head.norm(h^k_i))                              # DeepSeek-V3 and vLLM

`block` is one decoder layer of the policy's own family (its transformers class, layer index
`num_hidden_layers`), so the MTP layer can sit in the checkpoint as `model.layers.{N}.*`, where
vLLM's DeepSeek/GLM MTP loaders look for it. The embedding and LM head are the policy's own (shared,
not copied); `asyncrl.policy.checkpoint` writes copies of them under the MTP layer for loaders
that want them. As in vLLM, the token embedding at position 0 is zeroed, so a drafter served by
vLLM builds the same MTP key/value cache as the one trained here.

Training unrolls the layer to `policy.mtp.train_depth` depths and weighs them, L_MTP = sum_k lambda_k CE_k
(`policy.mtp.depth_weights`, as GLM-5 does); drafting chains the same layer for every draft token, so
drafts past the trained depth feed it hidden states it was never trained on.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask

from .token_logprobs import DEFAULT_CHUNK_TOKENS, masked_cross_entropy

# Per-layer lists in the policy config that the MTP layer's index must also be valid for.
_PER_LAYER_FIELDS = ("layer_types", "mlp_layer_types", "indexer_types")


def mtp_layer_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """The policy config extended by one layer, so a decoder layer can be built at index N."""
    extended = copy.deepcopy(config)
    for name in _PER_LAYER_FIELDS:
        values = getattr(extended, name, None)
        if isinstance(values, list) and len(values) == config.num_hidden_layers:
            # The MTP layer is a layer like the last one, except that it always runs its own DSA
            # indexer: there is no earlier layer in its stack to share top-k positions with.
            setattr(extended, name, [*values, "full" if name == "indexer_types" else values[-1]])
    extended.num_hidden_layers = config.num_hidden_layers + 1
    return extended


class SharedHead(nn.Module):
    """Holds the norm before the LM head, under the name (`shared_head.norm`) vLLM's MTP loaders read."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm


class MTPLayer(nn.Module):
    """enorm, hnorm, eh_proj, one decoder block, shared_head.norm (the LM head is the policy's)."""

    def __init__(self, policy: PreTrainedModel) -> None:
        super().__init__()
        self.layer_index: int = policy.config.num_hidden_layers
        self.config = mtp_layer_config(policy.config)
        hidden = self.config.hidden_size
        decoder_layer_class = type(policy.get_submodule("model.layers.0"))
        self.block = decoder_layer_class(self.config, self.layer_index)
        norm_class = type(self.block.get_submodule("input_layernorm"))
        self.enorm = norm_class(hidden, eps=self.config.rms_norm_eps)
        self.hnorm = norm_class(hidden, eps=self.config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(norm_class(hidden, eps=self.config.rms_norm_eps))
        # The policy's own initialiser, so experts and router start as the policy's layers did.
        self.apply(policy._init_weights)

    def forward(
        self,
        previous_hidden: torch.Tensor,
        token_embeds: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        cache=None,
    ) -> torch.Tensor:
        """One depth: [B, S, H] hidden states in, [B, S, H] (before shared_head.norm) out."""
        token_embeds = token_embeds.masked_fill((position_ids == 0).unsqueeze(-1), 0.0)
        mixed = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(previous_hidden)], dim=-1))
        out = self.block(
            mixed,
            attention_mask=attention_mask,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
            cache=cache,
            use_cache=cache is not None,
        )
        # GLM-DSA layers also return their DSA top-k indices; dense layers return the tensor alone.
        return out[0] if isinstance(out, tuple) else out


def build_mtp(policy: PreTrainedModel, seed: int | None = None) -> MTPLayer:
    if seed is not None:
        torch.manual_seed(seed)
    layer = MTPLayer(policy)
    return layer.to(dtype=next(policy.parameters()).dtype, device=next(policy.parameters()).device)


def decoder_and_head(policy: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The policy's decoder (`base_model`: `model` for most families, `transformer` for GPT-2) and its LM head."""
    assert isinstance(policy, PreTrainedModel)
    head = policy.get_output_embeddings()
    if head is None:
        raise ValueError(f"{policy.config.model_type}: the model has no LM head (get_output_embeddings() is None)")
    return policy.base_model, head


def policy_hidden_and_logits(
    policy: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's final (normed) hidden states and its logits, from one forward pass (any family;
    `check_plain_head` says whether decoder then head is the family's whole forward)."""
    hidden = policy_hidden(policy, input_ids, attention_mask)
    return hidden, decoder_and_head(policy)[1](hidden)


def policy_hidden(policy: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The policy's final (normed) hidden states: its decoder's forward, without the head."""
    # No cache: a full forward needs none, and a checkpointed layer must not write one twice.
    return decoder_and_head(policy)[0](input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def check_plain_head(policy: PreTrainedModel, key: str = "policy.path") -> None:
    """ValueError naming `key` when the policy's logits are not its output embeddings applied to its decoder's
    last hidden state (a family that scales or soft-caps its logits): the learner would then score
    another distribution than the engines sample, or when the head is no linear layer (the learner's log-softmax,
    `token_logprobs`, reads its weight and bias). Runs one forward of a few tokens."""
    head = decoder_and_head(policy)[1]
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{key}: {policy.config.model_type}'s output head is a {type(head).__name__}, not a linear layer")
    ids = torch.arange(min(6, policy.config.vocab_size), device=next(policy.parameters()).device)[None]
    mask = torch.ones_like(ids)
    with torch.no_grad():
        full = policy(input_ids=ids, attention_mask=mask).logits.float()
        split = policy_hidden_and_logits(policy, ids, mask)[1].float()
    gap = float((full - split).abs().max())
    if not gap <= 1e-3 * max(1.0, float(full.abs().max())):
        raise ValueError(
            f"{key}: {policy.config.model_type} does more to its logits than project the last hidden state "
            f"(gap {gap:.2e}); asyncrl's learner and embedded engine would score another distribution"
        )


def draft_hidden(
    policy: nn.Module,
    mtp: MTPLayer,
    previous_hidden: torch.Tensor,
    next_token_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    cache=None,
) -> torch.Tensor:
    """One MTP depth: the MTP layer's output [B, S, H], the next depth's input; the head reads it after the
    layer's shared-head norm (`mtp_logits`).

    `previous_hidden[:, s]` is the hidden state at position `position_ids[:, s]` (the policy's
    final hidden state, or the previous depth's output) and `next_token_ids[:, s]` the token that
    follows that position; the output predicts the token after that one. `attention_mask` is the
    2D padding mask over cached plus new positions; `cache`, if given, is a transformers cache
    built with `mtp.config` (the MTP layer keeps its keys and values at index `mtp.layer_index`).
    """
    decoder = policy.get_submodule("model")
    embeds = decoder.get_submodule("embed_tokens")(next_token_ids)
    mask = create_causal_mask(
        config=mtp.config,
        inputs_embeds=embeds,
        attention_mask=attention_mask,
        cache=cache,
        position_ids=position_ids,
        allow_is_causal_skip=False,  # the DSA indexer needs a real mask
    )
    rotary = decoder.get_submodule("rotary_emb")(previous_hidden, position_ids=position_ids)
    return mtp(previous_hidden, embeds, rotary, mask, position_ids, cache=cache)


def draft_states(
    policy: nn.Module,
    mtp: MTPLayer,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    depth: int,
    position_ids: torch.Tensor | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What the head reads at depths 1..depth over a whole (right-padded) batch: per depth k, (the normed states
    [B, T, H], whose position i predicts t_{i+k+1}; the ids [B, T] shifted so that position i+1 holds that
    token). `mtp_logits` is the head applied to the states. `position_ids`: packed rows' own (default 0..T-1)."""
    if position_ids is None:
        batch, length = input_ids.shape
        position_ids = torch.arange(length, device=input_ids.device).unsqueeze(0).expand(batch, -1)
    out, previous = [], hidden
    for k in range(1, depth + 1):
        shifted = F.pad(input_ids[:, k:], (0, k), value=0)
        previous = draft_hidden(policy, mtp, previous, shifted, position_ids, attention_mask)
        out.append((mtp.shared_head.norm(previous), shifted))
    return out


def mtp_logits(
    policy: nn.Module,
    mtp: MTPLayer,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    depth: int,
) -> list[torch.Tensor]:
    """Logits at depths 1..depth over a whole (right-padded) batch; entry k-1 predicts t_{i+k+1}.

    The last k positions of depth k have no token t_{i+k} to read; they see a zero embedding
    and their predictions are never trained.
    """
    head = policy.get_submodule("lm_head")
    return [head(states) for states, _ in draft_states(policy, mtp, hidden, input_ids, attention_mask, depth)]


def combine_depths(per_depth: Sequence[torch.Tensor], depth_weights: Sequence[float] | None = None) -> torch.Tensor:
    """L_MTP = sum_k lambda_k CE_k over the per-depth losses; no weights is the mean over depths."""
    stacked = torch.stack(list(per_depth))
    if depth_weights is None:
        return stacked.mean()
    if len(depth_weights) != len(per_depth):
        raise ValueError(f"{len(depth_weights)} depth weights for {len(per_depth)} depths")
    return (stacked * stacked.new_tensor(list(depth_weights))).sum()


def mtp_loss(
    policy: nn.Module,
    mtp: MTPLayer,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    loss_mask: torch.Tensor,
    depth: int,
    num_tokens: torch.Tensor | float | None = None,
    depth_weights: Sequence[float] | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """sum_k lambda_k CE_k over depths 1..depth of the masked cross-entropy (`loss_mask[:, j]` = train token j);
    `depth_weights` are the lambda_k (`MTPConfig.weights_per_depth()`), None the mean over depths. The head
    runs at trained positions only, `chunk_tokens` at a time (`token_logprobs.masked_cross_entropy`).

    Each depth's summed loss is divided by `num_tokens` when given (so micro-batches of one
    optimizer step can share the whole batch's count), else by that depth's own trained tokens.
    """
    losses = []
    head = policy.get_submodule("lm_head")
    for k, (states, shifted) in enumerate(draft_states(policy, mtp, hidden, input_ids, attention_mask, depth), start=1):
        # Position i of depth k predicts t_{i+k+1}, which `shifted` holds at i+1; the mask moves with it.
        weights = F.pad(loss_mask[:, k:], (0, k), value=0)
        count = loss_mask[:, k + 1 :].sum().clamp(min=1.0) if num_tokens is None else num_tokens
        losses.append(masked_cross_entropy(head, states, shifted, weights, chunk_tokens) / count)
    return combine_depths(losses, depth_weights)
