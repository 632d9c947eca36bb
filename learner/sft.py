"""The SFT training step: the next-token loss (and the MTP layer's) over rendered conversations, padded or packed.

The warm start's entry point (config, engine, evaluation, checkpoints, reporting) is `asyncrl/jobs/sft.py`;
the conversations are rendered by `sft_data.py`.

Packing (`sft.data.packing`) lays several conversations end to end in one row of a micro-batch
instead of one per padded row. Each conversation's position ids restart at 0 and the attention mask
is left out, which is how transformers reads packed rows (`find_packed_sequence_indices`: a position
id that does not follow the one before starts a new sequence, and every token attends only to the
earlier tokens of its own sequence; qwen3 and glm_moe_dsa alike, the DSA indexer included, as it
selects from the same mask). The first token of each conversation is no target (it would be
predicted from the previous one's last token; a padded row never trains its first token either),
and the MTP layer's targets that lie in another conversation than the position predicting them are
dropped, so a packed step has the loss and the gradient of the padded one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncrl.configs.schema import RunConfig, SFTConfig
from asyncrl.policy.mtp import combine_depths, decoder_and_head, draft_states, mtp_loss, policy_hidden
from asyncrl.policy.token_logprobs import DEFAULT_CHUNK_TOKENS, masked_cross_entropy

from .optim import build_optimizer
from .sft_data import Demo, collate, length_buckets


@dataclass
class Packed:
    """Conversations laid end to end: `position_ids` restart at 0 at the start of each one."""

    token_ids: list[int]
    loss_mask: list[int]
    position_ids: list[int]


def pack(demos: Sequence[Demo], length: int) -> list[Packed]:
    """First-fit decreasing into rows of at most `length` tokens (a longer conversation gets a row to itself)."""
    rows: list[Packed] = []
    for demo in sorted(demos, key=lambda d: len(d.token_ids), reverse=True):
        n = len(demo.token_ids)
        row = next((r for r in rows if len(r.token_ids) + n <= length), None)
        if row is None:
            row = Packed([], [], [])
            rows.append(row)
        row.token_ids += demo.token_ids
        row.loss_mask += [0, *demo.loss_mask[1:]]
        row.position_ids += list(range(n))
    return rows


def collate_packed(rows: Sequence[Packed], pad_token_id: int) -> dict[str, torch.Tensor]:
    """`collate`'s tensors plus position_ids, all [batch, longest]; the padding is a sequence of its
    own (positions from 0), so no real token attends to it (the attention_mask only counts tokens)."""
    batch = collate(rows, pad_token_id)
    positions = torch.arange(batch["input_ids"].shape[1]).repeat(len(rows), 1)
    for index, row in enumerate(rows):
        positions[index, : len(row.position_ids)] = torch.tensor(row.position_ids)
        positions[index, len(row.position_ids) :] -= len(row.position_ids)
    return {**batch, "position_ids": positions}


def micro_batches(demos: Sequence[Demo], pad_token_id: int, pack_length: int | None) -> Iterator[dict[str, torch.Tensor]]:
    """Length-bucketed micro-batches: padded rows, or with `pack_length` packed rows (with position_ids)."""
    if pack_length is None:
        for bucket in length_buckets(list(demos)):
            yield collate(bucket, pad_token_id)
    else:
        for rows in length_buckets(pack(demos, pack_length)):
            yield collate_packed(rows, pad_token_id)


def next_token_loss(
    model, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, num_tokens: float | None = None
) -> torch.Tensor:
    """Summed cross-entropy over the tokens the mask trains (`loss_mask[:, j]` = token j), divided by `num_tokens`
    (default: this batch's trained tokens, i.e. the token mean); the head runs at those tokens' positions only
    (`masked_cross_entropy`), from the policy's final hidden states."""
    count = loss_mask[:, 1:].sum().clamp(min=1.0) if num_tokens is None else num_tokens
    return masked_cross_entropy(decoder_and_head(model)[1], hidden, input_ids, loss_mask, DEFAULT_CHUNK_TOKENS) / count


def _hidden(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if "position_ids" not in batch:
        return policy_hidden(model, batch["input_ids"], batch["attention_mask"])
    # No attention mask and no cache: transformers then builds the per-sequence mask from the position ids.
    decoder = decoder_and_head(model)[0]
    return decoder(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).last_hidden_state


def _packed_mtp_loss(
    model, mtp, hidden: torch.Tensor, batch: dict[str, torch.Tensor], depth_weights: Sequence[float], num_tokens: float
) -> torch.Tensor:
    """`mtp_loss` over packed rows: packed positions, and targets in another sequence than their source dropped."""
    ids, positions, loss_mask = batch["input_ids"], batch["position_ids"], batch["loss_mask"]
    sequence = (torch.diff(positions, prepend=positions[:, :1] - 1) != 1).cumsum(-1)
    head, losses = model.get_submodule("lm_head"), []
    for k, (states, shifted) in enumerate(draft_states(model, mtp, hidden, ids, None, len(depth_weights), positions), start=1):
        # Position i predicts t_{i+k+1}, which `shifted` holds at i+1; targets in another sequence weigh 0.
        weights = F.pad(loss_mask[:, k + 1 :] * (sequence[:, k + 1 :] == sequence[:, : -k - 1]), (1, k), value=0)
        losses.append(masked_cross_entropy(head, states, shifted, weights, DEFAULT_CHUNK_TOKENS) / num_tokens)
    return combine_depths(losses, depth_weights)


def sft_optimizer(sft: SFTConfig, model, mtp, params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer `sft.optimizer` names (AdamW, Muon, Muon Split) over `params`, the policy's and its
    MTP layer's, at `sft.lr` and `sft.weight_decay`."""
    extra = [mtp] if mtp is not None else []
    return build_optimizer(sft.optimizer, model, params, lr=sft.lr, weight_decay=sft.weight_decay, extra=extra)


def train_step(
    config: RunConfig, model, mtp, demos: list[Demo], pad_token_id: int, pack_length: int | None = None
) -> tuple[float, float | None, int]:
    """Accumulate the gradients of one optimizer step over length-bucketed micro-batches (packed
    into rows of `pack_length` tokens when given).

    Returns the step's next-token loss, MTP loss (None without MTP) and token count. Both losses
    are token means over the whole step, so bucketing and packing change the cost and nothing else.
    """
    num_targets = float(sum(sum(d.loss_mask[1:]) for d in demos))
    depth_weights, weight = config.policy.mtp.weights_per_depth(), config.policy.mtp.loss_weight
    loss_total, aux_total, tokens = 0.0, 0.0, 0
    for batch in micro_batches(demos, pad_token_id, pack_length):
        ids, mask = batch["input_ids"], batch["loss_mask"]
        hidden = _hidden(model, batch)
        loss = next_token_loss(model, hidden, ids, mask, num_targets)
        total = loss
        if mtp is not None:
            if "position_ids" in batch:
                aux = _packed_mtp_loss(model, mtp, hidden, batch, depth_weights, num_targets)
            else:
                aux = mtp_loss(model, mtp, hidden, ids, batch["attention_mask"], mask, len(depth_weights), num_targets, depth_weights)
            total = total + weight * aux
            aux_total += aux.item()
        total.backward()
        loss_total += loss.item()
        tokens += int(batch["attention_mask"].sum())
    return loss_total, (aux_total if mtp is not None else None), tokens


@torch.no_grad()
def evaluation_loss(model, demos: Sequence[Demo], pad_token_id: int, pack_length: int | None = None) -> float:
    """The next-token loss over `demos` (token mean), no gradients: the held-out loss."""
    num_targets = float(sum(sum(d.loss_mask[1:]) for d in demos))
    total = 0.0
    for batch in micro_batches(demos, pad_token_id, pack_length):
        total += next_token_loss(model, _hidden(model, batch), batch["input_ids"], batch["loss_mask"], num_targets).item()
    return total
