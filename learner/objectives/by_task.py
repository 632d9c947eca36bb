"""A task mix's own objectives and loss weights (`tasks.mix.NAME.objective`, `tasks.mix.NAME.loss_weight`).

Rows of a task with an objective of its own take that objective's per-token loss; rows of a task with a
loss weight have theirs multiplied by it; every other row keeps the learner's objective. The masks and
ratios the consistency figures read are each row's own objective's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .base import Objective, ObjectiveOutput


@dataclass(frozen=True)
class TaskLoss:
    """One task's departures from the learner's loss."""

    objective: Objective | None
    """Its own objective; None: the learner's."""
    weight: float = 1.0
    """Multiplies its tokens' loss."""
    reads_old: bool = False
    """Its objective reads pi_old (the PPO family): several updates per batch then need pi_old's scoring pass."""


def by_task(
    default: Objective,
    losses: Mapping[str, TaskLoss],
    tasks: Sequence[str],
    logp: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    old: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """`default` on every row, then each row of a task in `losses` (`tasks[i]`: row i's) under its own."""
    out = default(logp, logp_rollout, advantages, loss_mask, old=old)
    per_token, kept, ratio = out.per_token, out.kept, out.ratio
    for task, loss in losses.items():
        rows = torch.tensor([name == task for name in tasks], device=logp.device)[:, None]
        if not bool(rows.any()):
            continue
        own = out if loss.objective is None else loss.objective(logp, logp_rollout, advantages, loss_mask, old=old)
        per_token = torch.where(rows, own.per_token * loss.weight, per_token)
        kept, ratio = torch.where(rows, own.kept, kept), torch.where(rows, own.ratio, ratio)
    return ObjectiveOutput(per_token, kept, ratio, loss_mask)
