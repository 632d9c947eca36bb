"""The math of on-policy cross-stage distillation (DESIGN §4), as pure functions of per-token tensors.

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

from __future__ import annotations

import torch


def distill_advantages(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] stop-grad(log pi_teacher - log pi_theta) on sampled tokens (loss mask 1), 0 elsewhere."""
    difference = teacher_logprobs.detach() - student_logprobs.detach()
    return torch.where(loss_mask.bool(), difference, torch.zeros_like(difference))


def reverse_kl(student_logprobs: list[float], teacher_logprobs: list[float], loss_mask: list[int]) -> tuple[float, int]:
    """(sum over sampled tokens of log pi_student - log pi_teacher, number of sampled tokens).

    The sum's mean is the Monte-Carlo estimate of KL(pi_student || pi_teacher) per token on the
    student's own samples: the quantity distillation drives down.
    """
    total, count = 0.0, 0
    for student, teacher, sampled in zip(student_logprobs, teacher_logprobs, loss_mask, strict=True):
        if sampled:
            total += student - teacher
            count += 1
    return total, count
