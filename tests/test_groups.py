"""GRPO groups between admission and the learner, and the batch they become (`asyncrl.samples.batch_of`):
every rollout of a group reaches the learner, so every rollout gets an account, even those with nothing to train on."""

from __future__ import annotations

import pytest

from asyncrl.learner.selection import select
from asyncrl.records import Trajectory, Turn
from asyncrl.samples import batch_of
from asyncrl.sched.groups import GroupBuffer


def trajectory(rollout_id: str, group_id: str, status: str = "ok", reward: float | None = 1.0, turns: int = 1) -> Trajectory:
    made = [Turn(rollout_id, [5, 6], [7, 8], [-0.1, -0.2], [0, 0], index=i) for i in range(turns)]
    return Trajectory(rollout_id=rollout_id, task="t", group_id=group_id, turns=made, status=status,
                      reward=None if status == "aborted" else reward)  # fmt: skip


def test_groups_complete_in_admission_order_and_count_as_ahead():
    buffer = GroupBuffer()
    buffer.open("g1", 2)
    buffer.open("g2", 2)
    assert buffer.rollouts == 4 and buffer.ready == 0
    buffer.add(trajectory("b1", "g2"))
    buffer.add(trajectory("b2", "g2", status="aborted"))
    buffer.add(trajectory("a1", "g1"))
    assert buffer.ready == 1 and buffer.take(2)[0].group_id == "g2"
    assert buffer.rollouts == 2 and buffer.take(1) == []  # g1 still waits for a rollout
    buffer.add(trajectory("a2", "g1"))
    assert [t.rollout_id for t in buffer.drain()] == ["a1", "a2"] and buffer.rollouts == 0


def test_a_trajectory_of_a_group_never_admitted_is_refused():
    with pytest.raises(ValueError, match="never admitted"):
        GroupBuffer().add(trajectory("x", "stray"))


def test_rollouts_without_samples_still_get_one_account_each():
    buffer = GroupBuffer()
    buffer.open("g", 4)
    for t in [trajectory("ok1", "g"), trajectory("ok2", "g", reward=0.0), trajectory("gone", "g", status="aborted"),
              trajectory("crash", "g", status="env_crash", reward=0.0, turns=0)]:  # fmt: skip
        buffer.add(t)
    batch = batch_of([group.trajectories for group in buffer.take(1)], crash_statuses=("env_crash", "error"))
    assert [[s.rollout_id for s in group] for group in batch.groups] == [["ok1", "ok2", "gone", "crash"]]
    selection = select(batch.groups, current_version=0, max_staleness=1, group_size=4, crash_statuses=("env_crash", "error"))
    assert selection.ledger() == {"aborted": 1, "dropped_crash": 1, "dropped_group": 2}  # 2 of 4 valid is not > half


def test_an_ok_episode_that_never_called_the_model_is_counted_as_aborted():
    buffer = GroupBuffer()
    buffer.open("g", 1)
    buffer.add(trajectory("silent", "g", turns=0))
    ((sample,),) = batch_of([group.trajectories for group in buffer.take(1)], crash_statuses=("env_crash",)).groups
    assert sample.status == "aborted" and sample.token_ids == []


def test_a_batch_keeps_its_groups_apart_and_in_order_with_a_forked_rollouts_samples_together():
    # a1's second turn does not extend its first (the same prompt again): a fork, two samples of one rollout
    first = [trajectory("a1", "g1", turns=2), trajectory("a2", "g1", status="aborted", turns=0)]
    batch = batch_of([first, [trajectory("b1", "g2")]], crash_statuses=("env_crash",))
    assert [[s.rollout_id for s in group] for group in batch.groups] == [["a1", "a1", "a2"], ["b1"]]
    assert [s.rollout_id for s in batch.samples] == ["a1", "a1", "a2", "b1"] and batch.rollout_ids == ["a1", "a2", "b1"]
    placeholder = batch.groups[0][2]
    assert placeholder.status == "aborted" and placeholder.token_ids == [] and placeholder.group_id == "g1"


def test_selection_refuses_a_group_that_mixes_groups_or_outgrows_the_group_size():
    mixed = batch_of([[trajectory("a", "g1"), trajectory("b", "g2")]], crash_statuses=())
    with pytest.raises(ValueError, match=r"mixes GRPO groups \['g1', 'g2'\]"):
        select(mixed.groups, current_version=0, max_staleness=1, group_size=2)
    crowded = batch_of([[trajectory("a", "g"), trajectory("b", "g"), trajectory("c", "g")]], crash_statuses=())
    with pytest.raises(ValueError, match="group 'g' has 3 rollouts, more than group_size=2"):
        select(crowded.groups, current_version=0, max_staleness=1, group_size=2)


def test_a_group_is_uniform_when_most_of_it_finished_with_one_reward():
    from asyncrl.sched.groups import Group, GroupBuffer, uniform

    def group(*outcomes):
        trajectories = [Trajectory(f"r{i}", group_id="g", status=status, reward=reward) for i, (status, reward) in enumerate(outcomes)]
        return Group("g", len(outcomes), trajectories)

    assert uniform(group(("ok", 1.0), ("ok", 1.0), ("ok", 1.0), ("env_crash", 0.0)), ["env_crash"])
    assert not uniform(group(("ok", 1.0), ("ok", 0.0), ("ok", 1.0), ("ok", 1.0)), ["env_crash"])
    # Half or fewer finished: the learner drops the group itself (dropped_group), so it is not uniform here.
    assert not uniform(group(("ok", 1.0), ("ok", 1.0), ("aborted", None), ("env_crash", 0.0)), ["env_crash"])
    buffer = GroupBuffer()
    for name, rewards in (("a", [1.0, 1.0]), ("b", [1.0, 0.0]), ("c", [0.0, 0.0])):
        buffer.open(name, 2)
        for i, reward in enumerate(rewards):
            buffer.add(Trajectory(f"{name}{i}", group_id=name, status="ok", reward=reward))
    assert [g.group_id for g in buffer.drop_uniform(1, [])] == ["a"]  # oldest first, at most the limit
    assert [g.group_id for g in buffer.drop_uniform(5, [])] == ["c"] and buffer.ready == 1
