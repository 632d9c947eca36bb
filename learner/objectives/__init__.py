"""The RL objectives (`learner.objective`), the rollout correction, loss aggregation and advantages.

Each objective is a pure function of per-token tensors in a module of its own, its formula in the module's
docstring; `build_objective` binds one to its config section. docs/ALGORITHMS.md has every formula, its
config keys, its reference test and what the peers call it.
"""

from __future__ import annotations

from functools import partial

from asyncrl.configs.objectives import DoubleSidedISObjective, GSPOObjective, IcepopGRPOObjective, ObjectiveConfig, PPOObjective

from .advantages import distill_advantages, group_advantages
from .aggregation import StepTotals, token_weights
from .base import Objective, ObjectiveOutput, importance_ratio
from .by_task import TaskLoss, by_task
from .cispo import cispo_loss
from .correction import rollout_correction
from .glm5 import double_sided_is_loss, icepop_grpo_loss
from .gspo import gspo_loss
from .ppo import ppo_loss

__all__ = [
    "Objective",
    "ObjectiveOutput",
    "StepTotals",
    "TaskLoss",
    "build_objective",
    "by_task",
    "cispo_loss",
    "distill_advantages",
    "double_sided_is_loss",
    "group_advantages",
    "gspo_loss",
    "icepop_grpo_loss",
    "importance_ratio",
    "ppo_loss",
    "rollout_correction",
    "token_weights",
]  # fmt: skip


def build_objective(config: ObjectiveConfig) -> Objective:
    """The objective `config.name` names, bound to its bounds."""
    if isinstance(config, IcepopGRPOObjective):
        return partial(icepop_grpo_loss, eps_low=config.eps_low, eps_high=config.eps_high, beta=config.beta)
    if isinstance(config, DoubleSidedISObjective):
        return partial(double_sided_is_loss, eps_low=config.eps_low, eps_high=config.eps_high)
    if isinstance(config, PPOObjective):
        return partial(ppo_loss, config=config)
    if isinstance(config, GSPOObjective):
        return partial(gspo_loss, config=config)
    return partial(cispo_loss, config=config)
