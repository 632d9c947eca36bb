"""Admission: how many GRPO groups of episodes may start now, from a handful of plain numbers.

Async admits while fewer than `max_inflight` episodes run and the rollouts ahead of the learner
would still be at most tau (`learner.max_staleness`) versions old when their batch is trained:

    ahead <= batch x (tau + 1 - lag)        in rollouts; batch = batch_groups x group_size

A rollout admitted now reaches the learner behind `ahead` others (admitted, not yet handed to the
learner), i.e. about ahead / batch steps from now, and the learner is already `lag` versions past
the weights the engines sample with (a step in flight counts as taken). Whole groups only: what is
left of the bound after `ahead` rounds down to a multiple of the group size.

Sync admits only while the learner is idle, up to one whole batch ahead, so it alternates generate,
train, push, and every trained token comes from the weights being trained (groups that dynamic
sampling drops are topped up from the same weights). Neither mode
admits once the steps left to take are covered by what the learner has taken or is taking.
"""

from __future__ import annotations

from typing import Literal

Mode = Literal["async", "sync"]


def groups_to_admit(
    *, mode: Mode, steps_left: int, in_flight: int, max_inflight: int, group_size: int, batch_groups: int,
    ahead: int, lag: int, tau: int, learner_idle: bool,
) -> int:  # fmt: skip
    """How many groups may start now.

    `steps_left`: optimizer steps still to take, not counting one in flight; `in_flight`: episodes
    running; `ahead`: rollouts admitted and not yet handed to the learner (running or finished);
    `lag`: learner version (a step in flight included) minus the version the engines serve.
    """
    if steps_left <= 0:
        return 0
    if mode == "sync":
        return max(0, batch_groups - ahead // group_size) if learner_idle else 0
    fresh = batch_groups * group_size * (tau + 1 - lag) - ahead
    room = max_inflight - in_flight
    return max(0, min(fresh, room) // group_size)
