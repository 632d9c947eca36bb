"""When a learner step makes a weight push and a checkpoint due (`asyncrl.records.due_after_step`), as a
table: a push when the step reached a multiple of push_every, a checkpoint when it reached one of
checkpoint_every, nothing when it took no optimizer step. Every expected value hand-computed."""

from __future__ import annotations

import pytest

from asyncrl.records import Due, due_after_step

ROWS = [
    # (before, after, push_every, checkpoint_every) -> (push, checkpoint)
    # no step: the version stays, even on a multiple of both
    ((0, 0, 1, 1), (False, False)),
    ((4, 4, 2, 4), (False, False)),
    ((6, 6, 3, 2), (False, False)),
    # push_every 1: every step pushes
    ((0, 1, 1, 5), (True, False)),
    ((3, 4, 1, 5), (True, False)),
    ((4, 5, 1, 5), (True, True)),
    # crossing a push multiple only
    ((1, 2, 2, 5), (True, False)),
    ((5, 6, 3, 10), (True, False)),
    # crossing a checkpoint multiple only
    ((4, 5, 2, 5), (False, True)),
    ((9, 10, 3, 5), (False, True)),
    # both
    ((3, 4, 2, 4), (True, True)),
    ((11, 12, 3, 4), (True, True)),
    # neither
    ((0, 1, 2, 5), (False, False)),
    ((6, 7, 3, 4), (False, False)),
    ((2, 3, 2, 2), (False, False)),  # just past a multiple of both
    # a multi-version jump reaches a multiple it did not land on
    ((1, 4, 3, 10), (True, False)),  # 3 is passed on the way to 4
    ((2, 6, 5, 4), (True, True)),  # 5 and 4 passed on the way to 6
    ((4, 5, 3, 7), (False, False)),  # within one multiple: nothing passed
    ((5, 8, 4, 10), (True, False)),  # 8 reached
    ((7, 13, 100, 10), (False, True)),  # 10 passed, 100 far away
    ((1, 2, 4, 8), (False, False)),
    ((3, 17, 4, 8), (True, True)),  # several multiples of each passed: still one push, one checkpoint
]


@pytest.mark.parametrize(("row", "expected"), ROWS)
def test_due_after_step(row, expected):
    before, after, push_every, checkpoint_every = row
    due = due_after_step(before, after, push_every=push_every, checkpoint_every=checkpoint_every)
    assert due == Due(*expected) and (due.push, due.checkpoint) == expected
