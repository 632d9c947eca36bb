"""KL to a reference policy (`learner.kl`): a frozen copy of the run's starting weights, and the estimators.

On the sampled tokens, with log r_t = log pi_ref(y_t) - log pi_theta(y_t) (Schulman's approximations of
KL(pi_theta || pi_ref) from samples of pi_theta):

    k1 = -log r                 unbiased, can go negative, high variance
    k2 = (log r)^2 / 2          biased, low variance; its gradient is that of the true KL's
    k3 = r - 1 - log r          unbiased and never negative (GRPO's, TRL's)

As a loss term (`mode: loss`) coef x k is added to every trained token's loss, with its gradient through
pi_theta, and aggregated like the objective. As a reward penalty (`mode: reward`) each sample's reward
loses coef x the sum of k over its trained tokens, with the engine's log-probs standing in for pi_theta
(the tokens were sampled from it), before the group-relative advantages: no gradient flows through it.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Literal

import torch
from transformers import PreTrainedModel

from asyncrl.configs.learner import LearnerConfig

from .batch import MicroBatch, Row, micro_batches
from .sharding import Scorer

Estimator = Literal["k1", "k2", "k3"]


def kl_estimate(logp: torch.Tensor, reference: torch.Tensor, estimator: Estimator) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from log pi_theta and log pi_ref of the sampled tokens."""
    log_r = reference - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    return torch.exp(log_r) - 1 - log_r


class Reference:
    """The policy as it was when the learner was built (the run's start), frozen, scoring like the learner."""

    def __init__(self, model: PreTrainedModel, chunk_tokens: int, autocast: torch.dtype | None = None) -> None:
        frozen = copy.deepcopy(model).eval().requires_grad_(False)
        self.scorer = Scorer(frozen, None, chunk_tokens, autocast)  # the learner's precision, so KL starts at 0

    @classmethod
    def for_learner(cls, config: LearnerConfig, model: PreTrainedModel, *, sharded: bool, autocast: torch.dtype | None) -> Reference | None:
        """The reference `learner.kl` needs (None at coef 0): a copy of `model` as the learner starts."""
        if config.kl.coef == 0:
            return None
        if sharded:
            raise ValueError("learner.kl: the reference policy is not sharded yet; use learner.sharding=replicate")
        return cls(model, config.logits_chunk_tokens, autocast)

    @torch.no_grad()
    def logprobs(self, batch: MicroBatch, routes: torch.Tensor | None) -> torch.Tensor:
        """[B, T-1] log pi_ref of the trained tokens of `batch` (on the reference's device), the rollout's elsewhere."""
        scored = (batch.input_ids, batch.attention_mask, batch.loss_mask, batch.temperatures, batch.rollout_logprobs)
        return self.scorer(*scored, routes, None, batch.prefix, batch.truncation)[0]


def reward_penalties(
    reference: Reference, rows: list[Row], pad: int, max_tokens: int, device: torch.device, estimator: Estimator
) -> list[float]:
    """Per row, the sum over its trained tokens of the estimate with pi_rollout for pi_theta (uncoefficiented)."""
    indexed = [dataclasses.replace(row, index=i) for i, row in enumerate(rows)]
    penalties = [0.0] * len(rows)
    for batch in micro_batches(indexed, pad, max_tokens):
        moved = batch.to(device)
        ref = reference.logprobs(moved, None)
        mask = moved.loss_mask[:, 1:].bool()
        per_token = torch.where(mask, kl_estimate(moved.rollout_logprobs[:, 1:], ref, estimator), torch.zeros_like(ref))
        for index, total in zip(batch.indices, per_token.sum(-1).tolist(), strict=True):
            penalties[index] = total
    return penalties
