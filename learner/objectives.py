"""The RL objectives of the learner, as pure functions of per-token tensors.

Both objectives use the rollout log-prob as the behaviour policy (GLM-5: no separate old-policy
forward), so one ratio drives everything:

    r_t = exp(log pi_theta(y_t) - log pi_rollout(y_t))

* `double_sided_is_loss` (agentic default): keep a token only when 1 - eps_low < r_t < 1 + eps_high
  (both bounds strict); loss -r_t * A over kept tokens, so the gradient flows through r_t.
* `icepop_grpo_loss` (reasoning default): zero tokens whose ratio lies outside [1/beta, beta]
  (bounds inclusive), then PPO clipping min(r A, clip(r, 1 - eps_low, 1 + eps_high) A); no KL term.

The masks are decided on detached ratios; the differentiable ratio is then exp of a log-ratio that
`torch.where` sets to 0 on every token outside the mask, so masked tokens give exactly zero gradient
and an overflowing ratio on a masked token cannot turn the gradient into NaN (0 * inf). The loss is summed over
kept tokens and divided by the number of trainable tokens (loss mask 1) in the batch, so masking a
token does not scale up the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor
    """Scalar to backpropagate."""
    kept: torch.Tensor
    """Bool [B, T]: tokens that contributed to the loss."""
    ratio: torch.Tensor
    """[B, T] observed importance ratios (detached) on trainable tokens, 1 elsewhere."""

    def stats(self, loss_mask: torch.Tensor) -> dict[str, float]:
        """Masked-token fraction and ratio statistics over trainable tokens."""
        trainable = loss_mask.bool()
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


def _per_token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sample [B] advantages to per-token [B, T]; per-token [B, T] pass through."""
    return advantages[:, None].expand_as(like) if advantages.dim() == 1 else advantages


def importance_ratio(logp: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """r = exp(logp - logp_rollout) where `mask` is set and exactly 1 (with no gradient) elsewhere."""
    log_ratio = torch.where(mask.bool(), logp - logp_rollout, torch.zeros_like(logp))
    return torch.exp(log_ratio)


def _finish(per_token: torch.Tensor, kept: torch.Tensor, ratio: torch.Tensor, loss_mask: torch.Tensor) -> ObjectiveOutput:
    contribution = torch.where(kept, per_token, torch.zeros_like(per_token))
    denominator = loss_mask.sum().clamp(min=1)
    return ObjectiveOutput(loss=contribution.sum() / denominator, kept=kept, ratio=ratio)


def double_sided_is_loss(
    logp: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> ObjectiveOutput:
    """Direct double-sided importance sampling with a hard token mask (GLM-5 agentic RL)."""
    observed = importance_ratio(logp.detach(), logp_rollout, loss_mask)
    kept = loss_mask.bool() & (observed > 1.0 - eps_low) & (observed < 1.0 + eps_high)
    ratio = importance_ratio(logp, logp_rollout, kept)
    per_token = -ratio * _per_token_advantages(advantages, ratio)
    return _finish(per_token, kept, observed, loss_mask)


def icepop_grpo_loss(
    logp: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    beta: float = 2.0,
) -> ObjectiveOutput:
    """GRPO with the IcePop mismatch mask and PPO-style clipping (GLM-5 reasoning RL)."""
    observed = importance_ratio(logp.detach(), logp_rollout, loss_mask)
    kept = loss_mask.bool() & (observed >= 1.0 / beta) & (observed <= beta)
    ratio = importance_ratio(logp, logp_rollout, kept)
    adv = _per_token_advantages(advantages, ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    return _finish(per_token, kept, observed, loss_mask)


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, optionally divided by the group's std.

    `group_index[i]` is a dense 0..G-1 id of sample i's group. A group whose rewards are all equal
    gets advantage 0 for every member (nothing to learn from it).
    """
    rewards = rewards.to(torch.float64)
    groups = int(group_index.max()) + 1 if group_index.numel() else 0
    counts = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(rewards))
    means = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_index, rewards) / counts
    centered = rewards - means[group_index]
    if not normalize_std:
        return centered.to(torch.float32)
    # Population std over each group, as GRPO implementations compute it.
    variances = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_index, centered**2) / counts
    return (centered / (variances.sqrt()[group_index] + eps)).to(torch.float32)


def distill_advantages(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] stop-grad(log pi_teacher - log pi_theta) on sampled tokens (loss mask 1), 0 elsewhere: the
    per-token advantage of on-policy cross-stage distillation (docs/LEARNER.md, "The rules").

    Per sampled token y_t of the student's own rollout:

        A_t = stop_grad( log pi_teacher(y_t) - log pi_theta(y_t) )

    log pi_theta is the learner's *current* log-prob of the token (its own forward in this step,
    detached), not the rollout log-prob the engine recorded. Both are at the same temperature, but the
    current one is of the very weights the step updates, in full precision, so the advantage is the
    per-token reverse-KL signal of the policy being trained; the gap between those weights and the ones
    that sampled (staleness, FP8 engines) is what the objective's importance ratio and masks handle,
    exactly as in RL. The teacher's log-prob comes from its own engine (rollout/scoring.py) and is a
    plain number here: no gradient can reach the teacher.

    With that advantage, -r_t * A_t (ratio r_t = pi_theta / pi_rollout) has the gradient of the
    per-token reverse KL, sum_t KL(pi_theta || pi_teacher) estimated on the sampled tokens.
    """
    difference = teacher_logprobs.detach() - student_logprobs.detach()
    return torch.where(loss_mask.bool(), difference, torch.zeros_like(difference))
