"""Learner steps to compare: two GRPO groups of samples whose rollout log-probs are the policy's own, and the
gradients each optimizer step receives (for tests/test_learner_prefix.py and tests/test_token_logprobs.py)."""

from __future__ import annotations

import torch

from asyncrl.learner.rl import RLLearner, sampled_logprobs
from asyncrl.records import UNSAMPLED_VERSION, Batch, Sample


def sample(model_learner: RLLearner, rollout: str, group: str, reward: float, prompt: list[int], completion: list[int], **turns) -> Sample:
    """A sample whose rollout log-probs are the policy's own at T = 1 (ratio 1)."""
    env, more = list(turns.get("env", [])), list(turns.get("more", []))
    tokens = prompt + completion + env + more
    mask = [0] * len(prompt) + [1] * len(completion) + [0] * len(env) + [1] * len(more)
    with torch.no_grad():
        logits = model_learner.model(input_ids=torch.tensor([tokens])).logits
        own = [0.0, *sampled_logprobs(logits, torch.tensor([tokens]), 1.0)[0].tolist()]
    logprobs = [lp if m else 0.0 for lp, m in zip(own, mask, strict=True)]
    versions = [0 if m else UNSAMPLED_VERSION for m in mask]
    return Sample(tokens, mask, logprobs, versions, reward, group, rollout, "ok")


def batch_for(learner: RLLearner) -> Batch:
    """Two GRPO groups of four, each over its own prompt, completions of different lengths, one of them
    a second turn after environment tokens."""
    p, q = [3, 4, 5, 6, 7, 8, 9], [12, 13, 14, 15, 16]
    return Batch([
        [
            sample(learner, "a", "g", 1.0, p, [20, 21, 22]),
            sample(learner, "b", "g", 0.0, p, [20, 23]),
            sample(learner, "c", "g", 0.5, p, [24, 25, 26, 27, 28]),
            sample(learner, "d", "g", 0.0, p, [29], env=[40, 41], more=[30, 31]),
        ],
        [
            sample(learner, "e", "h", 1.0, q, [20]),
            sample(learner, "f", "h", 0.0, q, [21, 22, 23, 24]),
            sample(learner, "g", "h", 0.2, q, [25, 26]),
            sample(learner, "h", "h", 0.0, q, [27, 28, 29]),
        ],
    ])  # fmt: skip


def record_gradients(learner: RLLearner) -> list[dict[str, torch.Tensor]]:
    """The gradients of the policy's weights at each optimizer step of `learner`, as it takes them."""
    taken: list[dict[str, torch.Tensor]] = []
    step = learner.optimizer.step

    def record_then_step(*args, **kwargs):
        taken.append({name: p.grad.clone() for name, p in learner.model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    learner.optimizer.step = record_then_step
    return taken
