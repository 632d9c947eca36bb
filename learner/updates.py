"""A step's optimizer updates: its rows cut into mini-batches, each a list of micro-batches, and pi_old.

One batch of rollouts may take several optimizer updates (`learner.mini_batches` per pass over it,
`learner.epochs` passes). The mini-batches are whole GRPO groups, in selection order, cut as evenly as
the groups allow; each is divided by its own totals (`aggregation.py`), as a step of its own would be.
The PPO family's pi_old is the policy before the batch's first update: with more than one update, every
micro-batch is scored once, without gradient, before any update (`score_old`); with one update pi_old is
the update's own log-probs, detached, and no pass is spent on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .batch import MicroBatch, Row, micro_batches
from .distributed import shard_rows
from .objectives import StepTotals
from .sharding import Scorer, matched_passes


@dataclass
class Update:
    """One optimizer update's share of the step on this rank."""

    batches: list[MicroBatch]
    """This rank's micro-batches of the update's computed rows."""
    totals: StepTotals
    """Of every selected row of the update's groups (all ranks), zero-advantage ones included."""
    computed_trainable: int
    """Trainable tokens of the update's computed rows, all ranks."""
    computes: bool
    """Whether any rank computes a row (an update of all-equal groups only takes no optimizer step)."""


def computes(row: Row, every_row: bool = False) -> bool:
    """A row that gives gradient: a trained token, and a nonzero advantage or a distillation row's per-token ones
    (`every_row`: any row with a trained token, as an entropy bonus gives each of them gradient)."""
    return any(row.loss_mask[1:]) and (every_row or row.advantage != 0.0 or row.teacher_logprobs is not None)


def plan_updates(
    rows: Sequence[Row],
    group_of: Sequence[int],
    parts: int,
    *,
    rank: int,
    world: int,
    pad: int,
    max_tokens: int,
    share: bool,
    every_row: bool = False,
) -> list[Update]:
    """`rows` (group `group_of[i]` each, in selection order) cut into at most `parts` updates of whole groups."""
    groups = list(dict.fromkeys(group_of))
    if not groups:
        return [Update([], StepTotals(tokens=0, samples=0), 0, computes=False)]
    cuts = [set(groups[round(i * len(groups) / parts) : round((i + 1) * len(groups) / parts)]) for i in range(parts)]
    updates = []
    for members in (cut for cut in cuts if cut):
        mine = [row for row, group in zip(rows, group_of, strict=True) if group in members]
        computed = [row for row in mine if computes(row, every_row)]
        totals = StepTotals(tokens=sum(sum(row.loss_mask[1:]) for row in mine), samples=sum(1 for row in mine if any(row.loss_mask[1:])))
        batches = micro_batches(shard_rows(computed, rank, world), pad, max_tokens, share)
        updates.append(Update(batches, totals, sum(sum(row.loss_mask[1:]) for row in computed), computes=bool(computed)))
    return updates


def score_old(scorer: Scorer, batches: list[MicroBatch], device: torch.device, *, routing_replay: bool, fsdp: bool) -> None:
    """Set every micro-batch's `old_logprobs` to the current policy's log-probs of its trained tokens (no gradient).
    Sharded, every rank makes as many passes as the rank with the most (each pass's gathers are collectives)."""
    passes = matched_passes(len(batches), device) if fsdp else len(batches)
    with torch.no_grad():
        for batch in batches:
            moved = batch.to(device)
            scored = (moved.input_ids, moved.attention_mask, moved.loss_mask, moved.temperatures, moved.rollout_logprobs)
            routes = moved.routes if routing_replay else None
            batch.old_logprobs = scorer(*scored, routes, None, moved.prefix, moved.truncation)[0].detach()
        for _ in range(passes - len(batches)):
            ids = torch.zeros((1, 2), dtype=torch.long, device=device)
            scorer(ids, torch.ones_like(ids), torch.zeros_like(ids), torch.ones_like(ids), torch.zeros_like(ids))
