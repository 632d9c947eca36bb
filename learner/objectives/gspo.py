"""GSPO (Qwen, "Group Sequence Policy Optimization"): one importance ratio per sample.

    s_i  = exp( (1 / |y_i|) sum_t log( pi_theta(y_i,t) / pi_old(y_i,t) ) )
    L_i  = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

Every trained token of sample i carries L_i (so `loss_aggregation: sequence_mean` gives the paper's
mean over samples) and its gradient flows through s_i from each of the sample's tokens. The rollout
correction (correction.py) weights each token as in `ppo`.
"""

from __future__ import annotations

import torch

from asyncrl.configs.objectives import GSPOObjective

from .base import ObjectiveOutput, finish, observed_ratio, per_token_advantages, sequence_mean
from .correction import rollout_correction


def gspo_loss(
    logp: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    old: torch.Tensor | None = None,
    config: GSPOObjective,
) -> ObjectiveOutput:
    """The clipped sequence-level surrogate, each sample's on each of its trained tokens."""
    old = logp.detach() if old is None else old
    weight, kept = rollout_correction(old, logp_rollout, loss_mask, config.correction)
    log_ratio = torch.where(kept, logp - old, torch.zeros_like(logp))
    ratio = torch.exp(sequence_mean(log_ratio, kept)).expand_as(logp)
    adv = per_token_advantages(advantages, ratio)
    clipped = torch.clamp(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high) * adv
    per_token = -weight * torch.minimum(ratio * adv, clipped)
    return finish(per_token, kept, observed_ratio(logp, logp_rollout, loss_mask), loss_mask)
