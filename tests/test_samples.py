"""Assembly of learner samples from trajectories: merging, forks, masks and alignment, by hand."""

from __future__ import annotations

import pytest

from asyncrl.gateway.store import open_store
from asyncrl.records import UNSAMPLED_VERSION, Sample, Trajectory, Turn
from asyncrl.samples import trajectory_to_samples

EOS = 1
TOOL = [40, 41, 42]  # a tool result the environment inserted: never trained on
USER = [50, 51]


def _trajectory(*turns: tuple[list[int], list[int], list[float], list[int]], **fields) -> Trajectory:
    rollout_id = fields.pop("rollout_id", "r1")
    return Trajectory(
        rollout_id=rollout_id,
        task="t",
        group_id="g",
        turns=[Turn(rollout_id, p, c, lp, v, index=i) for i, (p, c, lp, v) in enumerate(turns)],
        status=fields.pop("status", "ok"),
        reward=fields.pop("reward", 0.5),
        **fields,
    )


def _sampled(sample: Sample) -> list[tuple[int, float, int]]:
    return [(t, lp, v) for t, m, lp, v in zip(sample.token_ids, sample.loss_mask, sample.logprobs, sample.versions, strict=True) if m]


def test_prefix_consistent_turns_merge_into_one_sample() -> None:
    p0, c0 = [10, 11, 12], [20, 21, EOS]
    p1, c1 = p0 + c0 + TOOL, [22, EOS]
    p2, c2 = p1 + c1 + USER, [23]
    trajectory = _trajectory(
        (p0, c0, [-0.1, -0.2, -0.3], [5, 5, 6]),
        (p1, c1, [-0.4, -0.5], [6, 6]),
        (p2, c2, [-0.6], [7]),
    )
    (sample,) = trajectory_to_samples(trajectory)
    assert sample.token_ids == [10, 11, 12, 20, 21, EOS, 40, 41, 42, 22, EOS, 50, 51, 23]
    assert sample.loss_mask == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1]
    assert sample.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, -0.3, 0.0, 0.0, 0.0, -0.4, -0.5, 0.0, 0.0, -0.6]
    u = UNSAMPLED_VERSION
    assert sample.versions == [u, u, u, 5, 5, 6, u, u, u, 6, 6, u, u, 7]
    assert (sample.reward, sample.group_id, sample.rollout_id, sample.status, sample.task) == (0.5, "g", "r1", "ok", "t")
    assert (sample.branch, sample.turn_indices) == (0, [0, 1, 2])
    assert sample.oldest_version == 5


def test_a_rewritten_context_forks_and_later_turns_follow_their_branch() -> None:
    p0, c0 = [10, 11, 12], [20, EOS]
    rewritten, c1 = [10, 11, 99], [21, EOS]  # the agent edited its context: not an extension of p0 + c0
    p2, c2 = rewritten + c1 + TOOL, [22]  # continues the new branch
    p3, c3 = p0 + c0 + USER, [23, EOS]  # back to the first branch
    retry, c4 = list(p0), [24]  # the same prompt again: a second answer, a third branch
    trajectory = _trajectory(
        (p0, c0, [-0.1, -0.2], [1, 1]),
        (rewritten, c1, [-0.3, -0.4], [2, 2]),
        (p2, c2, [-0.5], [2]),
        (p3, c3, [-0.6, -0.7], [3, 3]),
        (retry, c4, [-0.8], [3]),
        reward=2.0,
    )
    first, second, third = trajectory_to_samples(trajectory)

    assert first.token_ids == p3 + c3
    assert first.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert _sampled(first) == [(20, -0.1, 1), (EOS, -0.2, 1), (23, -0.6, 3), (EOS, -0.7, 3)]
    assert first.turn_indices == [0, 3]

    assert second.token_ids == p2 + c2
    assert second.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert _sampled(second) == [(21, -0.3, 2), (EOS, -0.4, 2), (22, -0.5, 2)]
    assert second.turn_indices == [1, 2]

    assert third.token_ids == p0 + c4 and third.loss_mask == [0, 0, 0, 1]
    assert [s.branch for s in (first, second, third)] == [0, 1, 2]
    assert {(s.reward, s.group_id, s.rollout_id) for s in (first, second, third)} == {(2.0, "g", "r1")}


def test_one_changed_token_in_the_history_is_a_fork_not_a_merge() -> None:
    p0, c0 = [10, 11], [20, 21]
    almost = [*p0, 20, 22, *TOOL]  # bit-for-bit means bit for bit
    samples = trajectory_to_samples(_trajectory((p0, c0, [-1.0, -1.0], [0, 0]), (almost, [23], [-1.0], [0])))
    assert [s.token_ids for s in samples] == [p0 + c0, [*almost, 23]]
    assert samples[1].loss_mask == [0] * len(almost) + [1]


def test_every_sample_list_is_aligned_with_its_tokens() -> None:
    p0 = [3, 4]
    trajectory = _trajectory(
        (p0, [5], [-0.25], [0]),
        ([*p0, 5, *TOOL], [], [], []),  # an aborted generation samples nothing
        ([*p0, 5, *TOOL, *USER], [6, 7], [-0.5, -0.75], [1, 1]),
    )
    (sample,) = trajectory_to_samples(trajectory)
    n = len(sample.token_ids)
    assert len(sample.loss_mask) == len(sample.logprobs) == len(sample.versions) == n
    assert sum(sample.loss_mask) == 3
    assert all(
        lp == 0.0 and v == UNSAMPLED_VERSION for m, lp, v in zip(sample.loss_mask, sample.logprobs, sample.versions, strict=True) if not m
    )


def test_unfinished_and_aborted_trajectories() -> None:
    assert trajectory_to_samples(_trajectory(([1], [2], [-1.0], [0]), status="aborted", reward=None)) == []
    with pytest.raises(ValueError, match="not finished"):
        trajectory_to_samples(_trajectory(([1], [2], [-1.0], [0]), status="running", reward=None))
    crashed = trajectory_to_samples(_trajectory(([1], [2], [-1.0], [0]), status="env_crash", reward=0.0))
    assert [s.status for s in crashed] == ["env_crash"]  # the learner decides to drop it, and counts it
    assert trajectory_to_samples(_trajectory(reward=1.0)) == []


def test_samples_from_a_stored_trajectory(tmp_path) -> None:
    store = open_store(tmp_path / "run.db")
    rollout_id = store.open("t", "g")
    store.append(Turn(rollout_id, [7, 8], [9, EOS], [-0.1, -0.2], [4, 4]))
    store.append(Turn(rollout_id, [7, 8, 9, EOS, *TOOL], [10], [-0.3], [5]))
    store.finish(rollout_id, 1.0)
    (sample,) = trajectory_to_samples(store.get(rollout_id))
    assert sample.token_ids == [7, 8, 9, EOS, 40, 41, 42, 10]
    assert sample.loss_mask == [0, 0, 1, 1, 0, 0, 0, 1]
    assert _sampled(sample) == [(9, -0.1, 4), (EOS, -0.2, 4), (10, -0.3, 5)]
    store.close()


def test_each_sampled_token_carries_its_turns_temperature() -> None:
    p0, c0 = [10, 11], [20, EOS]
    p1, c1 = p0 + c0 + TOOL, [22]
    forked, c2 = [10, 99], [23, 24]
    trajectory = _trajectory((p0, c0, [-0.1, -0.2], [0, 0]), (p1, c1, [-0.3], [0]), (forked, c2, [-0.4, -0.5], [0, 0]))
    for turn, temperature in zip(trajectory.turns, (0.7, 0.0, 1.3), strict=True):
        turn.temperature, turn.top_p, turn.top_k = temperature, 1.0, 0
    merged, fork = trajectory_to_samples(trajectory)
    assert merged.temperatures == [None, None, 0.7, 0.7, None, None, None, 0.0]
    assert fork.temperatures == [None, None, 1.3, 1.3]
    # What the learner and the teachers score at: 1 for greedy, the run's where nothing was sampled.
    assert merged.scoring_temperatures(0.5) == [0.5, 0.5, 0.7, 0.7, 0.5, 0.5, 0.5, 1.0]
    assert merged.scoring_temperatures(0.0) == [1.0, 1.0, 0.7, 0.7, 1.0, 1.0, 1.0, 1.0]


def test_turns_without_a_recorded_temperature_give_samples_at_the_runs() -> None:
    (sample,) = trajectory_to_samples(_trajectory(([10, 11], [20], [-0.1], [0])))
    assert sample.temperatures is None
    assert sample.scoring_temperatures(0.8) == [0.8, 0.8, 0.8]
