"""PPO's clipped surrogate as GRPO uses it, with a rollout correction (correction.py).

    r_t  = pi_theta(y_t) / pi_old(y_t)
    L_t  = -w_t * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)

w_t is the correction's weight from pi_old / pi_rollout (1 with kind none: the plain GRPO loss). With
one update per batch pi_old is pi_theta before it (r_t = 1 with gradient); with several mini-batches or
epochs it is the learner's scoring pass before the first.
"""

from __future__ import annotations

import torch

from asyncrl.configs.objectives import PPOObjective

from .base import ObjectiveOutput, finish, importance_ratio, observed_ratio, per_token_advantages
from .correction import rollout_correction


def ppo_loss(
    logp: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    old: torch.Tensor | None = None,
    config: PPOObjective,
) -> ObjectiveOutput:
    """The clipped surrogate on pi_theta / pi_old, weighted by the correction."""
    old = logp.detach() if old is None else old
    weight, kept = rollout_correction(old, logp_rollout, loss_mask, config.correction)
    ratio = importance_ratio(logp, old, kept)
    adv = per_token_advantages(advantages, ratio)
    clipped = torch.clamp(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high) * adv
    per_token = -weight * torch.minimum(ratio * adv, clipped)
    return finish(per_token, kept, observed_ratio(logp, logp_rollout, loss_mask), loss_mask)
