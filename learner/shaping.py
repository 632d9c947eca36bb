"""From selected samples to the rows a step trains: rewards shaped, advantages, truncated samples filtered.

DAPO's two rules for completions that hit the token limit (`learner.overlong`), both off by default:

* soft overlong penalty: a sample of L sampled tokens, with L_max = `max_tokens` and a buffer B =
  `penalty_buffer`, gets its reward plus

      0                          L <= L_max - B
      (L_max - B - L) / B        L_max - B < L <= L_max
      -1                         L > L_max

  before the group-relative advantages, so a long answer is worth a little less than a short one
  with the same verdict;
* overlong filtering: a truncated sample (its last turn ended at the token limit) trains no token,
  while its reward still counts in its group's mean and spread; its rollout's account is
  `dropped_overlong`.
"""

from __future__ import annotations

import dataclasses

import torch

from asyncrl.configs.learner import LearnerConfig, OverlongConfig
from asyncrl.records import Account

from .batch import Row, to_rows
from .objectives import group_advantages
from .selection import Selection


def overlong_penalty(length: int, config: OverlongConfig) -> float:
    """The reward added to a sample of `length` sampled tokens (0 with the penalty off)."""
    if not config.penalty_buffer or config.max_tokens is None:
        return 0.0
    start = config.max_tokens - config.penalty_buffer
    if length <= start:
        return 0.0
    return -1.0 if length > config.max_tokens else (start - length) / config.penalty_buffer


def advantages_for(selection: Selection, normalize_std: bool, rewards: list[float] | None = None) -> list[float]:
    """Group-relative advantages of the selected batch (of `rewards`, else the samples'); exactly 0 for every
    all-equal group.

    The exact zero matters: a float mean of equal rewards can differ from them in the last bit,
    and only an exact zero lets those samples be skipped without changing the step.
    """
    if not selection.batch:
        return []
    values = torch.tensor([s.reward for s in selection.batch] if rewards is None else rewards, dtype=torch.float64)
    index = torch.tensor(selection.group_of)
    advantages = group_advantages(values, index, normalize_std=normalize_std).tolist()
    spread: dict[int, set[float]] = {}
    for group, reward in zip(selection.group_of, values.tolist(), strict=True):
        spread.setdefault(group, set()).add(reward)
    return [0.0 if len(spread[g]) == 1 else a for g, a in zip(selection.group_of, advantages, strict=True)]


def step_rows(
    selection: Selection, config: LearnerConfig, temperature: float, kl: list[float] | None = None
) -> tuple[list[Row], dict[str, float]]:
    """The rows of the selected samples with their advantages, the overlong rules applied (the filter also
    moves truncated rollouts to `dropped_overlong` in `selection.accounts`), `learner.kl.coef` x `kl` (each
    sample's summed KL estimate, under `kl.mode: reward`) off the rewards, and what the rules did."""
    overlong = config.overlong
    penalties = [overlong_penalty(sum(s.loss_mask), overlong) for s in selection.batch]
    kl = kl if kl is not None else [0.0] * len(selection.batch)
    rewards = [s.reward + p - config.kl.coef * k for s, p, k in zip(selection.batch, penalties, kl, strict=True)]
    rows = to_rows(selection.batch, advantages_for(selection, config.normalize_adv_std, rewards), temperature)
    filtered = 0
    if overlong.filter:
        for i, sample in enumerate(selection.batch):
            if sample.truncated:
                rows[i] = dataclasses.replace(rows[i], loss_mask=[0] * len(rows[i].loss_mask))
                selection.accounts[sample.rollout_id] = Account.DROPPED_OVERLONG
                filtered += 1
    penalized = sum(p < 0 for p in penalties)
    metrics = {
        "overlong_filtered": filtered, "overlong_penalized": penalized,
        "overlong_penalty_mean": sum(penalties) / penalized if penalized else 0.0,
        **({"kl_reward_penalty_mean": config.kl.coef * sum(kl) / len(kl)} if config.kl.mode == "reward" and kl else {}),
    }  # fmt: skip
    return rows, metrics
