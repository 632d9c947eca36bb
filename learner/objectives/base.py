"""What every objective takes and gives, and the arithmetic they share.

An objective is a pure function of per-token [B, T] tensors: the learner's log-probs of the sampled tokens
(log pi_theta, with gradient), pi_old's and pi_rollout's (detached), the advantages and the loss mask. It
returns the loss of every token, not a sum: how tokens become the step's loss (token mean, sequence mean,
Dr.GRPO's constant) is the learner's choice (`aggregation.py`), the same for every objective.

Masks are decided on detached ratios; a differentiable ratio is then exp of a log-ratio that `torch.where`
sets to 0 outside its mask, so masked tokens give exactly zero gradient and an overflowing ratio on a
masked token cannot turn the gradient into NaN (0 * inf).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class ObjectiveOutput:
    per_token: torch.Tensor
    """[B, T] loss of each token: 0 where the token is not trainable or the objective masked it."""
    kept: torch.Tensor
    """Bool [B, T]: trainable tokens the objective did not mask (clipping is not masking)."""
    ratio: torch.Tensor
    """[B, T] observed pi_theta / pi_rollout (detached) on trainable tokens, 1 elsewhere."""
    trainable: torch.Tensor
    """[B, T] the loss mask the objective was given."""

    @property
    def loss(self) -> torch.Tensor:
        """The token mean over these tensors' trainable tokens (the learner aggregates `per_token` itself)."""
        return self.per_token.sum() / self.trainable.sum().clamp(min=1)

    def stats(self) -> dict[str, float]:
        """Masked-token fraction and ratio statistics over trainable tokens."""
        trainable = self.trainable.bool()
        n = int(trainable.sum())
        if n == 0:
            return {"masked_token_frac": 0.0, "ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0, "trainable_tokens": 0}
        ratios = self.ratio[trainable]
        return {
            "masked_token_frac": 1.0 - float(self.kept[trainable].sum()) / n,
            "ratio_mean": float(ratios.mean()),
            "ratio_min": float(ratios.min()),
            "ratio_max": float(ratios.max()),
            "trainable_tokens": n,
        }


class Objective(Protocol):
    """(logp, logp_rollout, advantages [B] or [B, T], loss_mask, old=logp_old) -> ObjectiveOutput. `old` is
    pi_old's log-probs; None means the weights have not moved since they were scored (logp, detached)."""

    def __call__(
        self,
        logp: torch.Tensor,
        logp_rollout: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        *,
        old: torch.Tensor | None = None,
    ) -> ObjectiveOutput: ...


def per_token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sample [B] advantages to per-token [B, T]; per-token [B, T] pass through."""
    return advantages[:, None].expand_as(like) if advantages.dim() == 1 else advantages


def importance_ratio(logp: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(logp - reference) where `mask` is set and exactly 1 (with no gradient) elsewhere."""
    log_ratio = torch.where(mask.bool(), logp - reference, torch.zeros_like(logp))
    return torch.exp(log_ratio)


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, 1]: each row's mean of `values` over its masked tokens (0 for a row with none)."""
    weights = mask.to(values.dtype)
    return (values * weights).sum(-1, keepdim=True) / weights.sum(-1, keepdim=True).clamp(min=1)


def finish(per_token: torch.Tensor, kept: torch.Tensor, ratio: torch.Tensor, loss_mask: torch.Tensor) -> ObjectiveOutput:
    """The output with every token outside `kept` at exactly 0 loss."""
    return ObjectiveOutput(torch.where(kept, per_token, torch.zeros_like(per_token)), kept, ratio, loss_mask)


def observed_ratio(logp: torch.Tensor, logp_rollout: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """pi_theta / pi_rollout on trainable tokens, detached: what the consistency figures read."""
    return importance_ratio(logp.detach(), logp_rollout, loss_mask)
