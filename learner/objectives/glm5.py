"""GLM-5's two objectives: both compare pi_theta with pi_rollout directly, with no pi_old.

    r_t = exp(log pi_theta(y_t) - log pi_rollout(y_t))

* `double_sided_is_loss` (the report's agentic RL): keep a token only when 1 - eps_low < r_t < 1 + eps_high
  (both bounds strict); loss -r_t * A over kept tokens, so the gradient flows through r_t.
* `icepop_grpo_loss` (the report's reasoning RL): zero tokens whose ratio lies outside [1/beta, beta]
  (bounds inclusive), then PPO clipping, -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A); no KL term.
  IcePop's own form masks on pi_old / pi_rollout and clips on pi_theta / pi_old: that is `ppo` with a
  `mask` correction (ppo.py, correction.py).
"""

from __future__ import annotations

import torch

from .base import ObjectiveOutput, finish, importance_ratio, observed_ratio, per_token_advantages


def double_sided_is_loss(
    logp: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    old: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> ObjectiveOutput:
    """Direct double-sided importance sampling with a hard token mask (`old` is not read)."""
    observed = observed_ratio(logp, logp_rollout, loss_mask)
    kept = loss_mask.bool() & (observed > 1.0 - eps_low) & (observed < 1.0 + eps_high)
    ratio = importance_ratio(logp, logp_rollout, kept)
    per_token = -ratio * per_token_advantages(advantages, ratio)
    return finish(per_token, kept, observed, loss_mask)


def icepop_grpo_loss(
    logp: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    old: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    beta: float = 2.0,
) -> ObjectiveOutput:
    """GRPO with the mismatch mask and PPO clipping, both on pi_theta / pi_rollout (`old` is not read)."""
    observed = observed_ratio(logp, logp_rollout, loss_mask)
    kept = loss_mask.bool() & (observed >= 1.0 / beta) & (observed <= beta)
    ratio = importance_ratio(logp, logp_rollout, kept)
    adv = per_token_advantages(advantages, ratio)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    return finish(-torch.minimum(ratio * adv, clipped), kept, observed, loss_mask)
