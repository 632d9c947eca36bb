"""Admission (sched/admission.py) as a table: every expected count hand-computed from the rule
"ahead <= batch x (tau + 1 - lag)" once the admitted groups are ahead too, in whole groups, with at
most max_inflight episodes running.

Every row: group_size 4, batch_groups 2 (a batch is 8 rollouts), max_inflight 64, unless it says otherwise."""

from __future__ import annotations

import pytest

from asyncrl.sched.admission import groups_to_admit

BASE = dict(steps_left=10, in_flight=0, max_inflight=64, group_size=4, batch_groups=2, ahead=0, lag=0, learner_idle=True)

ASYNC = [
    # tau 0: only the next batch, sampled by the weights it trains
    (dict(tau=0), 2),  # 8 x 1 - 0 = 8 rollouts
    (dict(tau=0, ahead=4), 1),  # 8 - 4 = 4
    (dict(tau=0, ahead=6), 0),  # 8 - 6 = 2: less than a group
    (dict(tau=0, ahead=8), 0),  # 8 - 8 = 0
    (dict(tau=0, lag=1, ahead=0, learner_idle=False), 0),  # 8 x 0: a step in flight makes these one version stale
    # tau 1: one batch more
    (dict(tau=1), 4),  # 8 x 2 = 16
    (dict(tau=1, ahead=2), 3),  # 16 - 2 = 14 -> 3 groups
    (dict(tau=1, lag=1, ahead=8, learner_idle=False), 0),  # 8 x 1 - 8 = 0
    (dict(tau=1, lag=1, ahead=0, learner_idle=False), 2),  # 8 x 1 - 0 = 8
    (dict(tau=1, lag=2, ahead=0), 0),  # 8 x 0: the engines serve weights two versions old
    (dict(tau=1, lag=3, ahead=0), 0),  # 8 x -1: below zero is zero
    # tau 4: the staleness bound is far; max_inflight binds
    (dict(tau=4), 10),  # 8 x 5 = 40, room 64
    (dict(tau=4, ahead=12, lag=2, learner_idle=False), 3),  # 8 x 3 - 12 = 12
    (dict(tau=4, in_flight=48, ahead=48), 0),  # 40 - 48 < 0
    (dict(tau=4, in_flight=16, ahead=16), 6),  # 40 - 16 = 24, room 48
    (dict(tau=4, in_flight=16, ahead=16, max_inflight=24), 2),  # 24, room 8
    (dict(tau=4, in_flight=16, ahead=16, max_inflight=19), 0),  # room 3: less than a group
    (dict(tau=4, max_inflight=16), 4),  # room 16 -> 4 groups
    (dict(tau=4, group_size=8, batch_groups=1), 5),  # 8 x 5 = 40 -> 5 groups of 8
    (dict(tau=4, steps_left=1), 10),  # steps left are not a cap, only zero is
    (dict(tau=4, steps_left=0), 0),  # every step left is covered
    (dict(tau=4, steps_left=-1), 0),
]

SYNC = [
    # up to one whole batch ahead while the learner is idle, whatever tau and max_inflight
    (dict(tau=0), 2),
    (dict(tau=1), 2),
    (dict(tau=4), 2),
    (dict(tau=4, batch_groups=3), 3),
    (dict(tau=0, max_inflight=4), 2),
    (dict(tau=1, ahead=8), 0),  # a batch still being generated or waiting for the learner
    (dict(tau=1, ahead=4), 1),  # topped up to a batch (a group dynamic sampling dropped), from the same weights
    (dict(tau=1, ahead=0, learner_idle=False), 0),  # the learner is taking a step
    (dict(tau=4, ahead=8, learner_idle=False, lag=1), 0),
    (dict(tau=0, lag=3), 2),  # lag plays no part: sync pushes after every step
    (dict(tau=4, steps_left=0), 0),
]


@pytest.mark.parametrize(("row", "expected"), ASYNC)
def test_async_admission(row, expected):
    assert groups_to_admit(mode="async", **{**BASE, **row}) == expected


@pytest.mark.parametrize(("row", "expected"), SYNC)
def test_sync_admission(row, expected):
    assert groups_to_admit(mode="sync", **{**BASE, **row}) == expected
