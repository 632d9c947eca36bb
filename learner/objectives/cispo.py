"""CISPO (MiniMax-M1): clip the importance weight, not the update, so every token keeps a gradient.

    r_t  = pi_theta(y_t) / pi_old(y_t)
    L_t  = -w_t * sg( clip(r_t, 1 - eps_low, 1 + eps_high) ) * A * log pi_theta(y_t)

(no lower bound when eps_low is None, MiniMax-M1's setting). PPO's clip zeroes the gradient of a token
whose ratio left the band; here the weight saturates and the token's log-likelihood gradient stays.
w_t is the rollout correction's weight (correction.py).
"""

from __future__ import annotations

import torch

from asyncrl.configs.objectives import CISPOObjective

from .base import ObjectiveOutput, finish, importance_ratio, observed_ratio, per_token_advantages
from .correction import rollout_correction


def cispo_loss(
    logp: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    old: torch.Tensor | None = None,
    config: CISPOObjective,
) -> ObjectiveOutput:
    """The clipped, detached weight times the advantage-weighted log-likelihood."""
    old = logp.detach() if old is None else old
    weight, kept = rollout_correction(old, logp_rollout, loss_mask, config.correction)
    low = None if config.eps_low is None else 1.0 - config.eps_low
    clipped = importance_ratio(logp.detach(), old, kept).clamp(min=low, max=1.0 + config.eps_high)
    adv = per_token_advantages(advantages, logp)
    per_token = -weight * clipped * adv * torch.where(kept, logp, torch.zeros_like(logp))
    return finish(per_token, kept, observed_ratio(logp, logp_rollout, loss_mask), loss_mask)
