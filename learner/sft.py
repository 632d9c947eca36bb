"""The SFT training step: the next-token loss (and the MTP layer's) over rendered demonstrations.

The warm start's entry point (config, engine, evaluation, checkpoints, reporting) is `sched/sft.py`;
the demonstrations come from the environments and are rendered by `sft_data.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncrl.configs.schema import RunConfig
from asyncrl.policy.mtp import mtp_loss, policy_hidden_and_logits

from .sft_data import Demo, collate, length_buckets


def next_token_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, num_tokens: float | None = None
) -> torch.Tensor:
    """Summed cross-entropy over the tokens the mask trains (`loss_mask[:, j]` = token j), divided
    by `num_tokens` (default: this batch's trained tokens, i.e. the token mean)."""
    per_token = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="none")
    weights = loss_mask[:, 1:].reshape(-1)
    count = weights.sum().clamp(min=1.0) if num_tokens is None else num_tokens
    return (per_token * weights).sum() / count


def train_step(config: RunConfig, model, mtp, demos: list[Demo], pad_token_id: int) -> tuple[float, float | None, int]:
    """Accumulate the gradients of one optimizer step over length-bucketed micro-batches.

    Returns the step's next-token loss, MTP loss (None without MTP) and token count. Both losses
    are token means over the whole step, so bucketing changes the cost and nothing else.
    """
    num_targets = float(sum(sum(d.loss_mask[1:]) for d in demos))
    depth, weight = config.policy.mtp.train_depth, config.policy.mtp.loss_weight
    loss_total, aux_total, tokens = 0.0, 0.0, 0
    for bucket in length_buckets(demos):
        batch = collate(bucket, pad_token_id)
        ids, attention, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        hidden, logits = policy_hidden_and_logits(model, ids, attention)
        loss = next_token_loss(logits, ids, mask, num_targets)
        total = loss
        if mtp is not None:
            aux = mtp_loss(model, mtp, hidden, ids, attention, mask, depth, num_targets)
            total = total + weight * aux
            aux_total += aux.item()
        total.backward()
        loss_total += loss.item()
        tokens += int(attention.sum())
    return loss_total, (aux_total if mtp is not None else None), tokens
