"""Rollout correction: a weight on each token's loss for the gap between pi_old and pi_rollout.

The PPO family clips pi_theta / pi_old, which says nothing about how far the engine that sampled
(an older version, FP8, other kernels) was from pi_old. With rho = pi_old / pi_rollout measured at
`level`

    token       rho_t = pi_old(y_t) / pi_rollout(y_t)
    sequence    rho   = prod_t rho_t over the sample's trained tokens
    geometric   rho   = (prod_t rho_t) ** (1 / n), n trained tokens

each trained token's loss is multiplied by

    truncate    min(rho, high)                      TIS (truncated importance sampling)
    mask        rho if low <= rho <= high else 0    MIS; IcePop with [1/beta, beta];
                                                    AReaL's decoupled PPO with [0, cap]

and a token (at sequence levels, every token of the sample) whose weight a mask zeroed is not kept.
The weight is built from detached log-probs only: it scales the gradient, it never has one.
"""

from __future__ import annotations

import torch

from asyncrl.configs.objectives import CorrectionConfig

from .base import sequence_mean

MAX_LOG_WEIGHT = 80.0
"""A log-weight beyond this is held here before exp: exp(80) is finite in float32 and above any useful bound."""


def rollout_correction(
    old: torch.Tensor, logp_rollout: torch.Tensor, loss_mask: torch.Tensor, config: CorrectionConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] weight, [B, T] bool kept) of `config` on trainable tokens; weight 1 and kept elsewhere."""
    trainable = loss_mask.bool()
    if config.kind == "none":
        return torch.ones_like(old), trainable
    log_rho = torch.where(trainable, old.detach() - logp_rollout, torch.zeros_like(old))
    if config.level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(old)
    elif config.level == "geometric":
        log_rho = sequence_mean(log_rho, trainable).expand_as(old)
    rho = torch.exp(log_rho.clamp(max=MAX_LOG_WEIGHT))
    if config.kind == "truncate":
        return torch.where(trainable, rho.clamp(max=config.high), torch.ones_like(rho)), trainable
    inside = (rho >= config.low) & (rho <= config.high)
    kept = trainable & inside
    return torch.where(kept, rho, torch.where(trainable, torch.zeros_like(rho), torch.ones_like(rho))), kept
