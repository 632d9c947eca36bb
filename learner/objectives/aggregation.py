"""How per-token losses become the step's loss (`learner.loss_aggregation`), as one weight per token.

With N the step's samples (every selected sample with a trained token, zero-advantage ones included),
n_i sample i's trained tokens and T = sum_i n_i:

    token_mean      L = sum_i sum_t l_it / T            DAPO's; long samples weigh more
    sequence_mean   L = (1 / N) sum_i (1 / n_i) sum_t l_it   GRPO's; each sample weighs the same
    constant        L = sum_i sum_t l_it / (N * C)      Dr.GRPO's; no length bias (C: learner.loss_constant)

The totals are the whole step's, not a micro-batch's, so splitting a step into micro-batches or ranks
changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token_mean", "sequence_mean", "constant"]


@dataclass(frozen=True)
class StepTotals:
    """What the step's loss is divided by."""

    tokens: int
    """Trained tokens of every selected sample."""
    samples: int
    """Selected samples with at least one trained token."""


def token_weights(loss_mask: torch.Tensor, mode: Aggregation, totals: StepTotals, constant: int | None = None) -> torch.Tensor:
    """[B, T] float: the weight of each token's loss in the step's, 0 on untrained tokens."""
    mask = loss_mask.to(torch.float32)
    if mode == "token_mean":
        return mask / max(totals.tokens, 1)
    if mode == "sequence_mean":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1) * max(totals.samples, 1))
    if constant is None:
        raise ValueError("loss_aggregation constant needs learner.loss_constant")
    return mask / (max(totals.samples, 1) * constant)
