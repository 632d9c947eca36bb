"""Parts that die mid-run, and how the run goes on without them.

The loop's verbs read the same whether or not anything died. What to do when something does (how
often to try again, when to give up, what each recovery leaves in the record) is one policy, so it
lives here and not between the verbs.

    rollout worker  replaced by the worker group's supervision (`sched/supervision.py`); the loop admits
                    nothing and postpones evaluation while no engine serves, and `note_replacements`
                    records each replacement once it serves
    learner         `restart_learner`: a resume without leaving the process, from the last checkpoint
                    (the run's commit point), at most `LEARNER_RESTARTS` times per process

A learner restart does what `asyncrl run --resume` does at start-up (`asyncrl/jobs/run.py`), on the
loop's own state: it drops what the loop holds in flight (`InFlight`), rewinds the books, pushes the
new learner's weights through the loop's push and claims again what was not acknowledged. Each
recovery is a record in the metrics (`event`) and in `records` (`summary.json` `recoveries`), with how
long it took.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import closing
from typing import TYPE_CHECKING

from .groups import GroupBuffer
from .parts import LearnerDied, Parts
from .rundir import LoopState

if TYPE_CHECKING:
    from .episodes import Episodes
    from .loop import InFlight
    from .resume import Books

LEARNER_RESTARTS = 3
"""Learner deaths one run process recovers from; the next one ends the run (`asyncrl run --resume` goes on)."""

POLL_S = 0.05
"""How often a wait for a replacement engine looks again."""


class Recovery:
    def __init__(self, parts: Parts, books: Books, episodes: Episodes, flight: InFlight, push: Callable[[], Awaitable[None]]) -> None:
        """The loop's parts, books, episodes and state, and its push (the current weights to every engine)."""
        self.p, self.books, self.episodes, self.flight, self.push = parts, books, episodes, flight, push
        self.records: list[dict] = []  # every part that died and came back, in order
        self.restarts = 0

    def note_replacements(self) -> None:
        """Record the rollout workers the supervision replaced since the last look."""
        for replaced in self.p.supervision.replaced():
            self._record({"event": "worker_replaced", **replaced})
            self.p.display.say(f"rollout worker {replaced['engine_id']} died; {replaced['replacement']} serves version "
                               f"{replaced['version']} after {replaced['recovery_s']:.1f} s")  # fmt: skip

    async def serving(self, wait: bool = False) -> bool:
        """Whether an engine serves (none while the only one is being replaced); with `wait`, once one does."""
        while wait and not self.p.supervision.serving():
            self.p.supervision.check()  # a replacement that failed raises here instead of waiting forever
            await asyncio.sleep(POLL_S)
        return self.p.supervision.serving() > 0

    async def restart_learner(self, died: LearnerDied) -> None:
        """A learner that died is restarted from the last checkpoint, and the run goes on as `--resume`
        would have it: the books go back to that checkpoint's, the episodes in flight are aborted, and
        every rollout not acknowledged (trained by the dead learner since the checkpoint, in its lost
        step, waiting in groups, just aborted) is claimed again, whole groups, and trained once by the
        new learner. A new learner that dies too is restarted again. Raises `died` when it cannot (no
        way to reclaim, or `LEARNER_RESTARTS` already used)."""
        while True:
            if self.p.reclaim_store is None or self.restarts >= LEARNER_RESTARTS:
                raise died
            self.restarts += 1
            detected_at, began = time.time(), time.monotonic()
            try:
                checkpoint, recovered = await self._rewind()
            except LearnerDied as again:
                died = again
                continue
            break
        self._record({
            "event": "learner_restarted", "checkpoint": checkpoint, "recovered": recovered, "died": str(died),
            "detected_at": detected_at, "serving_at": time.time(), "recovery_s": time.monotonic() - began,
        })  # fmt: skip
        self.p.display.say(f"the learner died; restarted from {checkpoint or 'the starting policy'} at version "
                           f"{self.books.state.version}, {recovered} trajectories claimed again")  # fmt: skip

    async def _rewind(self) -> tuple[str | None, int]:
        """Back to the last checkpoint with a new learner: that checkpoint (None: the starting policy),
        and how many trajectories were claimed again."""
        flight, books = self.flight, self.books
        assert self.p.reclaim_store is not None
        flight.step = None  # the step in flight died with the learner; its groups are claimed again below
        await self.episodes.stop()
        latest = self.p.rundir.latest_checkpoint()
        checkpoint, saved = latest if latest else (None, LoopState(eval_before=books.state.eval_before))
        books.rewind(saved)
        flight.groups = GroupBuffer()
        await self.p.learner.restart(None if checkpoint is None else str(checkpoint))
        await self.push()
        flight.evaluated = min(flight.evaluated, flight.pushed)
        with closing(self.p.reclaim_store()) as reclaim:
            recovered = await books.recover(reclaim, flight.groups)
        return None if checkpoint is None else str(checkpoint), recovered

    def _record(self, record: dict) -> None:
        record = {**record, "step": self.books.state.version}
        self.records.append(record)
        self.p.metrics.record(record)
