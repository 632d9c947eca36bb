"""Advantages: GRPO's group-relative ones from rewards, and the per-token advantage of cross-stage distillation."""

from __future__ import annotations

import torch


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
