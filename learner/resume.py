"""The RL learner's checkpoint: an HF checkpoint of the policy (and MTP layer) with `STATE_FILE` beside it,
holding the optimizer's moments, the learning-rate schedule and the policy version, so a run resumes where it
stopped. Sharded learners gather the whole state onto rank 0, which writes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from asyncrl.policy.checkpoint import load_policy, save_policy

from .optim import check_param_groups
from .sharding import full_optimizer_state, load_full_model_state, load_optimizer_state

if TYPE_CHECKING:
    from .rl import RLLearner

STATE_FILE = "learner_state.pt"
"""Optimizer state, schedule and policy version, saved beside the HF checkpoint."""


def save_learner(learner: RLLearner, directory: Path) -> Path:
    """`learner`'s checkpoint in `directory`; rank 0 writes, the other ranks of a sharded learner join the gathers."""
    provenance = {"asyncrl": {"stage": "rl", "version": learner.version}}
    weights, mtp_weights, optimizer = None, None, learner.optimizer.state_dict()
    if learner.fsdp:
        (weights, mtp_weights), optimizer = learner.whole_state(), full_optimizer_state(learner.scorer, learner.optimizer)
        if learner.rank > 0:
            return directory
    directory = save_policy(
        directory, learner.model, learner.tokenizer, learner.mtp, extra_config=provenance, state_dict=weights, mtp_state=mtp_weights
    )
    scheduler, config = learner.scheduler.state_dict(), learner.config.model_dump()
    state = {"version": learner.version, "optimizer": optimizer, "scheduler": scheduler, "config": config}
    torch.save(state, directory / STATE_FILE)
    return directory


def load_learner(learner: RLLearner, directory: Path) -> None:
    """`learner` as `save_learner` left it: weights, MTP layer, optimizer moments, schedule, version."""
    model, _, mtp = load_policy(directory)
    if learner.fsdp:
        whole = {f"policy.{name}": t for name, t in model.state_dict().items()}
        if learner.mtp is not None and mtp is not None:
            whole.update({f"mtp.{name}": t for name, t in mtp.state_dict().items()})
        # A checkpoint without an MTP layer leaves this learner's fresh one as it is.
        load_full_model_state(learner.scorer, whole, strict=learner.mtp is None or mtp is not None)
    else:
        learner.model.load_state_dict(model.state_dict())
        if learner.mtp is not None and mtp is not None:
            learner.mtp.load_state_dict(mtp.state_dict())
    state = torch.load(directory / STATE_FILE, map_location=learner.device, weights_only=True)
    check_param_groups(learner.optimizer, state["optimizer"], directory)
    if learner.fsdp:
        load_optimizer_state(learner.scorer, learner.optimizer, state["optimizer"])
    else:
        learner.optimizer.load_state_dict(state["optimizer"])
    if "scheduler" in state:  # learner states saved before schedules existed start the schedule over
        learner.scheduler.load_state_dict(state["scheduler"])
    learner.version = int(state["version"])
