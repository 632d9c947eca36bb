"""Native forward of the policy's MTP layer (`asyncrl/policy/mtp.py`), the engine's drafter.

One depth: position i combines the hidden state that predicted token i+1 (the target's final,
normed hidden state, or the drafter's own output one position back when chaining drafts) with the
embedding of token i+1, runs one decoder block of the policy's family (its K/V in the cache layer
after the policy's last, index N), and predicts token i+2 through `shared_head.norm` and the
policy's own LM head. Chaining one layer for D drafts is what vLLM does with a one-layer MTP head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fp8 import linear, quantize_weights
from ..kv_cache import ForwardBatch, KVCache
from .common import last_tokens, weight_getter

_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


class NativeMTP:
    def __init__(self, model, state_dict: dict) -> None:
        """`model`: the native policy; `state_dict`: `MTPLayer.state_dict()` names (`block.*`, `enorm.weight`, ...)."""
        self.model = model
        self.index = model.config.num_hidden_layers
        self.eps = model.config.rms_norm_eps
        self.load_state_dict(state_dict)

    def load_state_dict(self, state_dict: dict) -> None:
        block_prefix = f"model.layers.{self.index}."
        # The block's parameters under the name its decoder layer would have in the policy.
        renamed = {block_prefix + k.removeprefix("block."): v for k, v in state_dict.items() if k.startswith("block.")}
        renamed.update({k: v for k, v in state_dict.items() if k in _OWN})
        get = weight_getter(renamed, dtype=self.model.dtype, device=self.model.device)
        weights = dict(
            block=self.model.layer_weights(get, self.index),
            enorm=get("enorm.weight"),
            hnorm=get("hnorm.weight"),
            eh_proj=get("eh_proj.weight"),
            shared_norm=get("shared_head.norm.weight"),
        )
        if self.model.fp8:
            quantize_weights(weights, self.model.linear_keys | {"eh_proj"}, prefix="mtp.")
        self.weights = weights

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, cache: KVCache, hidden: torch.Tensor, *, chained: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits [B, vocab] and block output [B, H] at each row's last token.

        Row b feeds, at positions starts[b] + j, the hidden state `hidden[b, j]` of that position and
        `batch.tokens[b, j]`, the token after it. `chained`: one token per row, never at position 0
        (drafts 2..D), which skips work that only a first position or ragged rows need.
        """
        w, size = self.weights, hidden.shape[-1]
        embeds = F.embedding(batch.tokens, self.model.weights["embed"])
        if not chained:
            # As in training (and vLLM): the token embedding at position 0 is zeroed.
            embeds = embeds.masked_fill((batch.positions == 0).unsqueeze(-1), 0.0)
        mixed = torch.cat([F.rms_norm(embeds, (size,), w["enorm"], self.eps), F.rms_norm(hidden, (size,), w["hnorm"], self.eps)], -1)
        h = self.model.layer(self.index, w["block"], linear(mixed, w["eh_proj"]), batch, cache, self.model.begin(batch))
        out = h[:, 0] if chained else last_tokens(h, batch)
        return self.model.logits(F.rms_norm(out, (size,), w["shared_norm"], self.eps)), out
