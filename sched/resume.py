"""What lets a run stop anywhere and go on: its books, their commit point, and taking back what a dead run left.

Every rollout the learner accounts for is booked at once (the ledger of `LoopState`), but it is
acknowledged in the store only when a checkpoint that holds its training is on disk (`checkpoint`:
save the learner, write the loop state listing the rollouts about to be acknowledged, acknowledge
them). So a run that dies loses nothing and re-trains nothing: on resume, `recover` aborts what the
dead run left running, finishes the acknowledgement its last checkpoint began, and claims again,
whole groups at a time, everything else it never acknowledged. The RL wall clock
(`loop.wall_budget_s`) is carried across restarts the same way, in the loop state.

Retention runs right after that commit point, so nothing a resume needs is ever gone: the checkpoints
the rule no longer keeps (`Retention`: `learner.keep_checkpoints_every`, `learner.keep_last_checkpoints`;
never the newest) are deleted, and with `store.keep_trajectories=false` so are the trajectories the
checkpoint just acknowledged (a resume finishing an acknowledgement deletes those too).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import time
from collections import defaultdict

from asyncrl.gateway.store import RolloutClosed, TrajectoryHandOff, TrajectoryStore
from asyncrl.gateway.store.base import TrajectoryPruner
from asyncrl.records import TERMINAL_STATUSES, Trajectory

from .groups import GroupBuffer
from .parts import LearnerClient
from .rundir import LoopState, Retention, RunDir

CONSUMER = "learner"
"""The store consumer name the loop claims and acknowledges trajectories under."""


class Books:
    def __init__(
        self, state: LoopState, store: TrajectoryStore, rundir: RunDir, learner: LearnerClient,
        *, retention: Retention | None = None, keep_trajectories: bool = True,
    ) -> None:  # fmt: skip
        self.state, self.store, self.rundir, self.learner = state, store, rundir, learner
        self.retention = retention or Retention()
        self.keep_trajectories = keep_trajectories
        self.unacked: list[str] = []  # accounted since the last checkpoint
        self.seen: set[str] = set()  # a lease that expires comes back once more; never count it twice
        self.started_at = time.monotonic()  # of this process's share of the RL wall clock since the last checkpoint

    def elapsed(self) -> float:
        """Seconds of RL loop, earlier processes of this run included."""
        return self.state.rl_wall_s + time.monotonic() - self.started_at

    def first_claim(self, trajectory: Trajectory) -> bool:
        """True the first time this run claims `trajectory`."""
        if trajectory.rollout_id in self.seen:
            return False
        self.seen.add(trajectory.rollout_id)
        return True

    def book(self, ledger: dict[str, int], rollout_ids: list[str]) -> None:
        """A learner step's accounts, one per rollout it was handed."""
        if sum(ledger.values()) != len(rollout_ids):
            raise RuntimeError(f"the learner accounted for {sum(ledger.values())} of {len(rollout_ids)} rollouts")
        for account, n in ledger.items():
            self.state.ledger[account] += n
        self.unacked += rollout_ids

    def book_untrained(self, leftovers: list[Trajectory]) -> None:
        """Rollouts the run ends without training: aborted."""
        self.state.ledger["aborted"] += len(leftovers)
        self.unacked += [t.rollout_id for t in leftovers]

    def rewind(self, saved: LoopState) -> None:
        """Back to a checkpoint's books (a learner restarts from it in this process): what was booked
        since is unacknowledged, so it is claimed and booked again. The wall clock runs on."""
        elapsed = self.elapsed()
        for field in dataclasses.fields(LoopState):
            setattr(self.state, field.name, copy.deepcopy(getattr(saved, field.name)))
        self.state.rl_wall_s, self.started_at = elapsed, time.monotonic()
        self.unacked = []

    async def checkpoint(self) -> None:
        """Save the learner, then acknowledge what it trained (the loop state lists them first, so a
        crash between the two is finished on resume: `recover` acknowledges `acking`)."""
        directory = self.rundir.checkpoint_dir(self.state.version)
        await self.learner.save(str(directory))
        self.state.rl_wall_s += time.monotonic() - self.started_at
        self.started_at = time.monotonic()
        self.state.acking = list(self.unacked)
        self.rundir.commit_checkpoint(directory, self.state)
        await asyncio.to_thread(self.store.ack, CONSUMER, self.unacked)
        await asyncio.to_thread(self._forget, self.unacked)
        self.unacked = []
        await asyncio.to_thread(self.rundir.retire_checkpoints, self.retention)

    def _forget(self, acknowledged: list[str]) -> None:
        """With `store.keep_trajectories=false`, delete trajectories the learner just acknowledged."""
        if self.keep_trajectories or not acknowledged:
            return
        if not isinstance(self.store, TrajectoryPruner):
            raise TypeError(f"{self.store!r} cannot delete trajectories (store.keep_trajectories=false needs one that can)")
        self.store.delete(acknowledged)

    async def recover(self, reclaim_store: TrajectoryHandOff, groups: GroupBuffer) -> int:
        """Take back what a dead run left into `groups`; returns how many trajectories it claimed again.

        `reclaim_store` is this store with no visibility timeout: the dead run's leases count as expired.
        """
        await asyncio.to_thread(abort_running, self.store, "the run stopped before this rollout ended")
        total = sum(self.store.counts()[status] for status in TERMINAL_STATUSES)
        left = await asyncio.to_thread(reclaim_store.claim, CONSUMER, max(total, 1)) if total else []
        await asyncio.to_thread(self.store.ack, CONSUMER, self.state.acking)
        await asyncio.to_thread(self._forget, self.state.acking)
        acked, by_group = set(self.state.acking), defaultdict(list)
        for trajectory in left:
            if trajectory.rollout_id not in acked:
                by_group[trajectory.group_id].append(trajectory)
        for group_id, members in by_group.items():  # whole groups: a checkpoint acknowledges groups whole
            groups.open(group_id, len(members))
            for trajectory in members:
                self.seen.add(trajectory.rollout_id)
                groups.add(trajectory)
        return sum(map(len, by_group.values()))


def abort_running(store: TrajectoryStore, reason: str) -> int:
    """Abort every rollout the store still holds as running (episodes the run no longer drives)."""
    running = store.list(status="running")
    for trajectory in running:
        with contextlib.suppress(RolloutClosed):  # it ended on its own meanwhile
            store.abort(trajectory.rollout_id, reason)
    return len(running)
