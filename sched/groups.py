"""GRPO groups on their way from admission to the learner.

A group is opened when its episodes are admitted and fills up as the store hands over its finished
trajectories (aborted ones included). It is complete when every rollout of it is terminal; complete
groups leave in admission order, a whole batch at a time. Everything the buffer holds is "ahead" of
the learner: admission control counts it to bound how stale the next samples can get.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncrl.records import Trajectory


@dataclass
class Group:
    group_id: str
    size: int
    """Rollouts the group will have (learner.group_size, or fewer for a dead run's leftovers)."""
    trajectories: list[Trajectory] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return len(self.trajectories) >= self.size


def uniform(group: Group, crash_statuses: Sequence[str]) -> bool:
    """Dynamic sampling's test: more than half of the group finished (neither aborted nor crashed, so the learner
    would train it) and every one of those earned the same reward, so no member has an advantage."""
    finished = [t.reward for t in group.trajectories if t.status not in ("aborted", *crash_statuses) and t.reward is not None]
    return 2 * len(finished) > group.size and len(set(finished)) == 1


class GroupBuffer:
    def __init__(self) -> None:
        self._groups: dict[str, Group] = {}  # insertion order is admission order

    def open(self, group_id: str, size: int) -> None:
        self._groups[group_id] = Group(group_id, size)

    def add(self, trajectory: Trajectory) -> None:
        group = self._groups.get(trajectory.group_id)
        if group is None:
            raise ValueError(f"rollout {trajectory.rollout_id} belongs to group {trajectory.group_id!r}, "
                             "which this run never admitted (is another run writing to this store?)")  # fmt: skip
        group.trajectories.append(trajectory)

    @property
    def ready(self) -> int:
        """Complete groups waiting for the learner."""
        return sum(group.complete for group in self._groups.values())

    @property
    def rollouts(self) -> int:
        """Rollouts admitted and not yet handed to the learner (running or finished)."""
        return sum(group.size for group in self._groups.values())

    def drop_uniform(self, limit: int, crash_statuses: Sequence[str]) -> list[Group]:
        """Up to `limit` complete groups without signal (`uniform`), oldest first, removed from the buffer."""
        dropped = [group for group in self._groups.values() if group.complete and uniform(group, crash_statuses)][:limit]
        for group in dropped:
            del self._groups[group.group_id]
        return dropped

    def take(self, n: int) -> list[Group]:
        """The `n` oldest complete groups, removed from the buffer."""
        taken = [group for group in self._groups.values() if group.complete][:n]
        for group in taken:
            del self._groups[group.group_id]
        return taken

    def drain(self) -> list[Trajectory]:
        """Every finished trajectory still held (the run is ending); the buffer is emptied."""
        held = [t for group in self._groups.values() for t in group.trajectories]
        self._groups.clear()
        return held
