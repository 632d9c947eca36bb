"""The scheduler loop: a few named verbs, repeated until the learner has taken `loop.steps` steps.

    admit     start GRPO groups of episodes while the admission rule allows (`sched/admission.py`:
              in-flight and staleness bounds), each group's task picked by the task mix (`sched/tasks.py`)
    collect   claim finished trajectories (aborted ones too) from the store into their groups
    train     hand complete groups to the learner as one `Batch` (episodes keep running meanwhile), scored
              by their stages' teachers first in a distillation run; when the step returns, book it
              (`sched/steps.py`), push weights and checkpoint when it made them due
              (`asyncrl.records.due_after_step`; the next step starts while the engines load the weights)
    evaluate  each task's held-out greedy success every `loop.eval_every` versions (`sched/evaluation.py`):
              between pushes on the serving engines, or beside training on an engine of its own
    report    the live display

Each round collects and trains before it admits (a group's episodes starting keep the driver busy
for a while, and the learner should not wait on that), and a round that booked a step comes round
again at once: its push freed admission. Async and sync runs are this same loop with a different
admission rule. The learner and the engines are reached through small clients (`sched/parts.py`).
Trajectories are acknowledged in the store only at a checkpoint, so a run that dies loses nothing and
re-trains nothing (`recover`, `sched/resume.py`). The loop's state in this process beyond the books is
one `InFlight`, which the recovery of a part that dies mid-run rewinds (`sched/recovery.py`) and `close`
drains, ending a run with every rollout in exactly one account of the ledger (`sched/shutdown.py`).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field

from asyncrl.configs.schema import RunConfig
from asyncrl.gateway.store import TrajectoryHandOff
from asyncrl.records import Account, StepResult, due_after_step
from asyncrl.samples import batch_of

from . import shutdown
from .admission import groups_to_admit
from .episodes import Episodes
from .evaluation import Finished, heldout_scores, record_evaluation
from .groups import Group, GroupBuffer
from .parts import LearnerDied, Parts, Weights
from .recovery import Recovery
from .resume import CONSUMER, Books
from .rundir import LoopState, Retention
from .steps import batch_record, consistency_warnings, learn, no_signal_notice, step_record
from .weight_push import DirectPush

TICK_S = 0.05
"""Pause between rounds of the loop; episodes and the learner run on without it."""


@dataclass
class InFlight:
    """What the loop holds in this process besides its books (`LoopState`, which checkpoints keep): gone
    with the process, rewound when the learner restarts, drained when the run closes."""

    pushed: int
    """The version the engines serve."""
    evaluated: int
    """The version last evaluated."""
    evaluated_at: float
    """The run's time (`Books.elapsed`) when the last evaluation began."""
    accuracy: float | None
    """The last held-out accuracy."""
    groups: GroupBuffer = field(default_factory=GroupBuffer)
    step: tuple[asyncio.Future, list[Group]] | None = None
    """The learner step in flight, and the groups it was handed."""
    closing: bool = False
    """Set by `close`: no step starts after it."""
    unstepped: int = 0
    """Batches in a row that took no optimizer step (no rollout had an advantage)."""
    last: dict = field(default_factory=dict)
    """The last step's record."""
    dropped_uniform: int = 0
    """Groups without signal dropped since the last step began (`learner.dynamic_sampling`)."""
    dropped_total: int = 0
    """Groups without signal dropped in this process."""


class Loop:
    def __init__(self, config: RunConfig, parts: Parts, state: LoopState) -> None:
        self.config, self.p, self.state = config, parts, state
        self.group_size, self.batch_groups = config.learner.group_size, config.learner.batch_groups
        self.books = Books(
            state, parts.store, parts.rundir, parts.learner,
            retention=Retention.from_config(config.learner), keep_trajectories=config.store.keep_trajectories,
        )  # fmt: skip
        self.episodes = Episodes(parts.gateway, parts.http, config.loop.episode_timeout_s)
        self.flight = InFlight(pushed=state.version, evaluated=state.version, evaluated_at=self.books.elapsed(), accuracy=state.eval_before)
        self.rng = random.Random(f"{config.seed}-{state.version}")
        self.t0, self.collected = time.monotonic(), 0
        self.recovery = Recovery(parts, self.books, self.episodes, self.flight, self.push)
        self.recoveries = self.recovery.records  # every part that died and came back, in order

    async def run(self) -> None:
        while not self.finished():
            stepped = False
            try:
                await self.collect()
                stepped = await self.train()  # before admitting: a group of episodes starting keeps the driver busy
                self.admit()
                await self.evaluate()
                self.report()
            except LearnerDied as died:
                await self.recovery.restart_learner(died)
            if not stepped:  # a step that came back freed admission: admit again at once
                await self.idle()

    async def idle(self) -> None:
        """`TICK_S`, or less: until the learner step in flight comes back (the engines wait on its push)."""
        if self.flight.step is None:
            await asyncio.sleep(TICK_S)
        else:
            await asyncio.wait([self.flight.step[0]], timeout=TICK_S)

    def finished(self) -> bool:
        return self.flight.closing or self.stop_reason() is not None

    def stop_reason(self) -> str | None:
        """Why the run stops: `steps` reached, `no_signal` (loop.max_batches_without_step), `wall_budget`;
        None while none holds."""
        limit = self.config.loop.max_batches_without_step
        if self.state.version >= self.config.loop.steps:
            return "steps"
        if limit and self.flight.unstepped >= limit:
            return "no_signal"
        return "wall_budget" if self.out_of_time() else None

    def out_of_time(self) -> bool:
        budget = self.config.loop.wall_budget_s
        return budget is not None and self.books.elapsed() >= budget

    def admit(self) -> None:
        self.episodes.check()
        self.p.supervision.check()
        if not self.p.supervision.serving():
            return  # the only engine is being replaced: new episodes would fail at their first call
        loop, flight, taking = self.config.loop, self.flight, self.flight.step is not None
        allowed = 0 if self.stop_reason() is not None else groups_to_admit(
            mode=loop.mode, steps_left=loop.steps - self.state.version - taking, in_flight=len(self.episodes),
            max_inflight=loop.max_inflight, group_size=self.group_size, batch_groups=self.batch_groups,
            ahead=flight.groups.rollouts, lag=self.state.version + taking - flight.pushed,
            tau=self.config.learner.max_staleness, learner_idle=not taking,
        )  # fmt: skip
        for _ in range(allowed):
            task = self.p.tasks.pick()
            if task is None:
                return  # every task is at its rate limit
            # Each group's problem is drawn from a seed of its own, recorded with its rollouts, so a
            # replay draws the same problem again (`asyncrl replay episode`).
            task_seed, group_id = self.rng.getrandbits(63), uuid.uuid4().hex[:16]
            problem = task.env.sample_task(random.Random(task_seed), "train")
            flight.groups.open(group_id, self.group_size)
            self.episodes.start_group(task, problem, group_id, self.group_size, admitted_at_version=flight.pushed, task_seed=task_seed)

    async def collect(self) -> None:
        claim_batch = self.config.store.claim_batch
        while True:
            claimed = await asyncio.to_thread(self.p.store.claim, CONSUMER, claim_batch)
            for trajectory in claimed:
                if self.books.first_claim(trajectory):
                    self.flight.groups.add(trajectory)
                    self.collected += 1
            if len(claimed) < claim_batch:
                return

    async def train(self) -> bool:
        """Book the step in flight if it came back, and start the next when a batch is ready; whether one came back."""
        came_back = self.flight.step is not None and self.flight.step[0].done()
        if came_back:
            await self.finish_step()
        self.start_step()
        return came_back

    def start_step(self) -> None:
        flight = self.flight
        if not self.finished():
            self.drop_uniform()
        if flight.step is None and flight.groups.ready >= self.batch_groups and not self.finished():
            flight.dropped_uniform = 0
            groups = flight.groups.take(self.batch_groups)
            batch = batch_of([group.trajectories for group in groups], self.config.learner.crash_statuses)
            flight.step = asyncio.ensure_future(learn(self.p, batch)), groups

    def drop_uniform(self) -> None:
        """`learner.dynamic_sampling`: complete groups whose rollouts all earned one reward leave the buffer, booked as
        dropped_no_signal, so admission draws more in their place; at most `max_dropped` x batch_groups per step."""
        sampling, learner = self.config.learner.dynamic_sampling, self.config.learner
        if not sampling.enabled:
            return
        limit = int(sampling.max_dropped * self.batch_groups) - self.flight.dropped_uniform
        for group in self.flight.groups.drop_uniform(max(limit, 0), learner.crash_statuses):
            ids = [t.rollout_id for t in group.trajectories]
            self.books.book({Account.DROPPED_NO_SIGNAL.value: len(ids)}, ids)
            self.flight.dropped_uniform += 1
            self.flight.dropped_total += 1

    async def finish_step(self) -> None:
        """Book the step in flight once it returns: its ledger, a push and a checkpoint when due, its records."""
        flight = self.flight
        assert flight.step is not None
        (future, groups), flight.step = flight.step, None
        result: StepResult = await future
        self.books.book(result.ledger, [t.rollout_id for group in groups for t in group.trajectories])
        before, self.state.version = self.state.version, result.version
        if self.config.loop.record_batches and result.stepped:
            self.p.rundir.write_batch(batch_record(result, groups, learner_version=before, distilled=self.p.teachers is not None))
        learner = self.config.learner
        due = due_after_step(before, result.version, push_every=learner.push_every, checkpoint_every=learner.checkpoint_every)
        if due.push:
            weights = await self.p.learner.weights()  # taken before the next step is sent, so of this version
            if not due.checkpoint and not isinstance(weights, DirectPush):  # a learner that sends them itself waits
                # The learner trains the next batch while the engines load these weights (they were
                # idle meanwhile: staleness holds admission until the push). Not before a checkpoint,
                # which saves the learner at the version the books record.
                self.start_step()
            await self.push(weights)
        if due.checkpoint:
            await self.books.checkpoint()
        flight.last = step_record(
            result, groups, elapsed_s=self.books.elapsed(), push_due=due.push, pushed_version=flight.pushed,
            in_flight=len(self.episodes), ahead=flight.groups.rollouts,
        )  # fmt: skip
        flight.last["dropped_no_signal_groups"] = flight.dropped_total
        self.p.metrics.record(flight.last)
        for warning in consistency_warnings(result):
            self.p.display.say(warning)
        flight.unstepped = 0 if result.stepped else flight.unstepped + 1
        if notice := no_signal_notice(flight.unstepped, flight.last):
            self.p.display.say(notice)

    async def push(self, weights: Weights | None = None) -> None:
        """The learner's weights (or `weights`, taken from it at this version) to every engine; the loop
        waits (no admission meanwhile), the episodes do not. An evaluation on its own engine that this push
        makes due begins with these weights."""
        version = self.state.version
        weights = weights if weights is not None else await self.p.learner.weights()
        try:
            await self.p.workers.push(weights, version)
        except Exception:
            await self.p.learner.check()  # weights that never came, because the learner died: LearnerDied
            raise
        self.flight.pushed = version
        aside = self.p.evaluation
        if aside is not None and not self.flight.closing and not aside.playing and self.evaluation_due():
            self.flight.evaluated_at = self.books.elapsed()
            await aside.begin(weights, version, self.flight.evaluated_at)

    def evaluation_due(self) -> bool:
        """A version served that was not evaluated, and `loop.eval_every` versions or `loop.eval_every_s`
        seconds since the last evaluation."""
        flight, every_s = self.flight, self.config.loop.eval_every_s
        if flight.pushed - flight.evaluated >= self.config.loop.eval_every:
            return True
        return every_s is not None and flight.pushed > flight.evaluated and self.books.elapsed() - flight.evaluated_at >= every_s

    async def evaluate_first(self) -> None:
        """The held-out figure the run starts from (`state.eval_before`): now, on the serving engines; or with
        an engine of its own, played there beside the first steps and booked when it ends."""
        if self.p.evaluation is None:
            self.state.eval_before = await self.evaluate(force=True)
            return
        self.flight.evaluated_at = self.books.elapsed()
        await self.p.evaluation.begin(await self.p.learner.weights(), self.state.version, self.flight.evaluated_at)

    async def evaluate(self, force: bool = False) -> float | None:
        """Book an evaluation played aside that has ended; with the shared engines, evaluate now when one is
        due (or `force`d: the run's first and last, which wait for one playing aside first)."""
        flight = self.flight
        if self.p.evaluation is not None:
            self.book_aside(await self.p.evaluation.wait() if force else self.p.evaluation.finished())
            if not force:
                return None  # evaluations on the own engine begin at the push that makes them due
            if flight.evaluated == flight.pushed and flight.accuracy is not None:
                return flight.accuracy
        elif not force and not self.evaluation_due():
            return None
        if not await self.recovery.serving(wait=force):  # the only engine is being replaced: later, or wait if forced
            return None
        began, flight.evaluated_at = time.monotonic(), self.books.elapsed()
        scores = await heldout_scores(self.config, self.p.tasks, self.p.gateway, self.p.http)
        wall_s = time.monotonic() - began
        accuracy = record_evaluation(self.p, scores, flight.pushed, flight.evaluated_at, wall_s, held_training=not force)
        flight.accuracy, flight.evaluated = accuracy, flight.pushed
        return flight.accuracy

    def book_aside(self, finished: Finished | None) -> None:
        """An evaluation played on the own engine: its result into the books; a failed one is said, and the
        run evaluates between pushes from then on."""
        if finished is None:
            return
        if finished.evals is None:
            self.p.display.say(f"the evaluation of version {finished.version} on its own engine failed ({finished.error!r}); "
                               "evaluating between pushes on the serving engines from now on")  # fmt: skip
            self.p.evaluation = None
            return
        accuracy = record_evaluation(self.p, finished.evals, finished.version, finished.elapsed_s, finished.wall_s, aside=True)
        if self.state.eval_before is None:  # the run's first evaluation (`evaluate_first`)
            self.state.eval_before = accuracy
        if finished.version >= self.flight.evaluated:
            self.flight.accuracy, self.flight.evaluated = accuracy, finished.version

    def report(self) -> None:
        self.recovery.note_replacements()
        flight, elapsed = self.flight, max(self.books.elapsed(), 1e-9)
        self.p.display.update({
            "mode": self.config.loop.mode, "step": self.state.version, "steps": self.config.loop.steps,
            "elapsed_s": elapsed, "reward": flight.last.get("reward"), "accuracy": flight.accuracy,
            "accuracy_before": self.state.eval_before, "staleness": flight.last.get("staleness_mean"),
            "rollouts_per_s": self.collected / (time.monotonic() - self.t0 + 1e-9),
            "samples_per_s": self.state.ledger["trained"] / elapsed, "in_flight": len(self.episodes),
            "ahead": flight.groups.rollouts, "ledger": self.state.ledger,
        })  # fmt: skip

    async def recover(self, reclaim_store: TrajectoryHandOff) -> int:
        """Take back what a dead run of this run directory left (`Books.recover`); how many trajectories."""
        return await self.books.recover(reclaim_store, self.flight.groups)

    async def close(self) -> float | None:
        """End the run with balanced books (`sched/shutdown.py`); the final held-out accuracy. A learner that
        dies meanwhile is restarted from its last checkpoint and the run trains again up to its end first."""
        while True:
            try:
                return await shutdown.close(self)
            except LearnerDied as died:
                await self.recovery.restart_learner(died)
                self.flight.closing = False
                await self.run()
