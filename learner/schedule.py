"""The learning rate over optimizer steps (`learner.schedule`): linear warm-up, then constant, linear or cosine decay.

RL fine-tuning starts from a trained policy whose Adam moments are empty: the first updates, scaled by
moments estimated from a handful of gradients, are the largest and noisiest, so the rate ramps up over
`warmup_steps`; a decay to `min_lr_ratio` x lr lets a long run settle instead of drifting at full rate.

The multiplier of lr at 0-based optimizer step s (W = warmup_steps, D = decay_steps, m = min_lr_ratio):

    s < W               (s + 1) / W                             (lr / W at the first step, lr at step W - 1)
    constant            1
    linear              m + (1 - m) (1 - p)                     p = clamp((s - W) / (D - W), 0, 1)
    cosine              m + (1 - m) (1 + cos(pi p)) / 2

so the decay starts from lr at step W, reaches m x lr at step D (counted from the first step, warm-up
included) and stays there. The config refuses D <= W and a decay without D.

`build_scheduler` is a `torch.optim.lr_scheduler.LambdaLR` over every param group (AdamW's, Muon's and the
no-decay group alike; `CombinedOptimizer` hands out its inner optimizers' groups): each group's rate is its
own base rate (the one it was built with) times the multiplier. Call its `step()` after each optimizer
step; its state_dict (the step count and base rates, no function) loads with torch.load(weights_only=True).
"""

from __future__ import annotations

import math

import torch

from asyncrl.configs.learner import ScheduleConfig


def lr_factor(schedule: ScheduleConfig, step: int) -> float:
    """The multiplier of lr at 0-based optimizer step `step` (the module docstring's formula)."""
    if step < 0:
        raise ValueError(f"optimizer step {step} < 0")
    warmup = schedule.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if schedule.kind == "constant":
        return 1.0
    if schedule.decay_steps is None:
        raise ValueError(f"kind {schedule.kind} decays over decay_steps: set it")
    progress = min(max((step - warmup) / (schedule.decay_steps - warmup), 0.0), 1.0)
    remaining = 1.0 - progress if schedule.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return schedule.min_lr_ratio + (1.0 - schedule.min_lr_ratio) * remaining


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: ScheduleConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR setting every param group's lr to its base lr x `lr_factor(schedule, step)`; built before the
    first optimizer step (it sets step 0's rate at once), stepped after each."""

    def factor(step: int) -> float:
        return lr_factor(schedule, step)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
