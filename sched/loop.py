"""The scheduler loop: a few named verbs, repeated until the learner has taken `loop.steps` steps.

    admit     start GRPO groups of episodes while the admission rule allows (`sched/admission.py`:
              in-flight and staleness bounds), each group's task picked by the task mix (shares and
              rate limits: `sched/tasks.py`)
    collect   claim finished trajectories (aborted ones too) from the store into their groups
    train     hand complete groups to the learner (episodes keep running meanwhile), scored by their
              stages' teachers first in a distillation run (distill/); when the step returns, book
              its ledger, push weights when due, checkpoint when due
    evaluate  each task's held-out greedy success every `loop.eval_every` versions (`sched/evaluation.py`)
    report    the live display

Async and sync runs are this same loop with a different admission rule. The learner and the engines
are reached through two small clients (`sched/parts.py`): Ray actors in `asyncrl run`, or objects in
this process (`sched/clients.py`). Trajectories are acknowledged in the store only at a checkpoint,
so a run that dies loses nothing and re-trains nothing (`recover`, `sched/resume.py`); `close` ends
a run with every rollout in exactly one account of the ledger.

Parts that die mid-run: a rollout worker is replaced by its worker group (the loop admits nothing
while no engine serves, and notes each replacement); a learner is restarted from the last
checkpoint by `restart_learner`, which is a resume without leaving the process. Each recovery is a
record in the metrics (`event`) and in `recoveries`, with how long it took.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

from asyncrl.configs.schema import RunConfig
from asyncrl.gateway.store import TrajectoryStore
from asyncrl.records import Sample

from .admission import groups_to_admit
from .episodes import Episodes
from .evaluation import heldout_scores, record_evaluation
from .groups import Group, GroupBuffer, group_samples
from .parts import LearnerDied, Parts
from .resume import CONSUMER, Books, abort_running
from .rundir import BatchRecord, LoopState, Retention

TICK_S = 0.05
"""Pause between rounds of the loop; episodes and the learner run on without it."""

LEARNER_RESTARTS = 3
"""Learner deaths one run process recovers from; the next one ends the run (`asyncrl run --resume` goes on)."""


class Loop:
    def __init__(self, config: RunConfig, parts: Parts, state: LoopState) -> None:
        self.config, self.p, self.state = config, parts, state
        self.group_size, self.batch_groups = config.learner.group_size, config.learner.batch_groups
        self.groups = GroupBuffer()
        self.books = Books(
            state, parts.store, parts.rundir, parts.learner,
            retention=Retention.from_config(config.learner), keep_trajectories=config.store.keep_trajectories,
        )  # fmt: skip
        self.episodes = Episodes(parts.gateway, parts.http, config.loop.episode_timeout_s)
        self.pending: tuple[asyncio.Future, list[Group]] | None = None  # the learner step in flight
        self.pushed = self.evaluated = state.version  # version the engines serve / last evaluated
        self.rng = random.Random(f"{config.seed}-{state.version}")
        self.t0, self.collected = time.monotonic(), 0
        self.last: dict = {}  # the last step's record
        self.accuracy = state.eval_before
        self.recoveries: list[dict] = []  # every part that died and came back, in order
        self.restarts = 0

    async def run(self) -> None:
        while not self.finished():
            try:
                self.admit()
                await self.collect()
                await self.train()
                await self.evaluate()
                self.report()
            except LearnerDied as died:
                await self.restart_learner(died)
            await asyncio.sleep(TICK_S)

    def finished(self) -> bool:
        return self.state.version >= self.config.loop.steps or self.out_of_time()

    def out_of_time(self) -> bool:
        budget = self.config.loop.wall_budget_s
        return budget is not None and self.books.elapsed() >= budget

    def admit(self) -> None:
        self.episodes.check()
        self.p.workers.check()
        if not self.p.workers.serving():
            return  # the only engine is being replaced: new episodes would fail at their first call
        loop, taking = self.config.loop, self.pending is not None
        allowed = 0 if self.out_of_time() else groups_to_admit(
            mode=loop.mode, steps_left=loop.steps - self.state.version - taking, in_flight=len(self.episodes),
            max_inflight=loop.max_inflight, group_size=self.group_size, batch_groups=self.batch_groups,
            ahead=self.groups.rollouts, lag=self.state.version + taking - self.pushed,
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
            self.groups.open(group_id, self.group_size)
            self.episodes.start_group(task, problem, group_id, self.group_size, admitted_at_version=self.pushed, task_seed=task_seed)

    async def collect(self) -> None:
        claim_batch = self.config.store.claim_batch
        while True:
            claimed = await asyncio.to_thread(self.p.store.claim, CONSUMER, claim_batch)
            for trajectory in claimed:
                if self.books.first_claim(trajectory):
                    self.groups.add(trajectory)
                    self.collected += 1
            if len(claimed) < claim_batch:
                return

    async def train(self) -> None:
        if self.pending is not None and self.pending[0].done():
            await self._finish_step()
        if self.pending is None and self.groups.ready >= self.batch_groups and not self.finished():
            groups = self.groups.take(self.batch_groups)
            samples = group_samples(groups, self.config.learner.crash_statuses)
            self.pending = asyncio.ensure_future(self._learn(samples)), groups

    async def _learn(self, samples: list[Sample]) -> dict:
        """One learner step; in distillation the teachers score the samples first (their metrics join the step's)."""
        scored: dict = {}
        if self.p.teachers is not None:
            samples, scored = await self.p.teachers.score(samples)
        return {**await self.p.learner.train_step(samples), **scored}

    async def _finish_step(self) -> None:
        """Book the step in flight once it returns: its ledger, then a push and a checkpoint when due."""
        assert self.pending is not None
        (future, groups), self.pending = self.pending, None
        metrics = await future
        self.books.book(metrics["ledger"], [t.rollout_id for group in groups for t in group.trajectories])
        before, self.state.version = self.state.version, metrics["version"]
        if self.config.loop.record_batches and metrics["stepped"]:
            self._record_batch(before, groups, metrics)
        if metrics["push_due"]:
            await self.push()
        if self.state.version // self.config.learner.checkpoint_every > before // self.config.learner.checkpoint_every:
            await self.books.checkpoint()
        rewards = [t.reward for group in groups for t in group.trajectories if t.status != "aborted" and t.reward is not None]
        lags = metrics.pop("staleness")
        self.last = {
            "step": self.state.version, "elapsed_s": self.books.elapsed(), "reward": sum(rewards) / max(len(rewards), 1),
            "staleness_mean": sum(int(k) * v for k, v in lags.items()) / max(sum(lags.values()), 1),
            "staleness_max": max(map(int, lags), default=0), "pushed_version": self.pushed,
            "in_flight": len(self.episodes), "ahead": self.groups.rollouts, **metrics,
        }  # fmt: skip
        self.p.metrics.record(self.last)
        for gap in metrics.get("consistency_warnings", ()):
            self.p.display.say(f"step {self.state.version}: task {gap['task']!r} turn {gap['turn']}: mean |learner - rollout| "
                               f"log-prob {gap['gap']:.3f} over {gap['tokens']} tokens > learner.logprob_gap_warning")  # fmt: skip

    def _record_batch(self, before: int, groups: list[Group], metrics: dict) -> None:
        """What this step trained, by reference (`asyncrl replay train` re-runs it). Only a step that
        stepped: one that did not leaves the version, and so the record of the step that made it, alone."""
        self.p.rundir.write_batch(BatchRecord(
            step=metrics["version"], learner_version=before,
            groups=[[t.rollout_id for t in group.trajectories] for group in groups],
            ledger=dict(metrics["ledger"]), padded=metrics["padded"], loss=metrics["loss"],
            grad_norm=metrics["grad_norm"], distilled=self.p.teachers is not None,
        ))  # fmt: skip

    async def push(self) -> None:
        """Weights to every engine; the loop waits (no admission meanwhile), the episodes do not."""
        version = self.state.version
        weights = await self.p.learner.weights()
        try:
            await self.p.workers.update_weights(weights, version)
        except Exception:
            await self.p.learner.check()  # weights that never came, because the learner died: LearnerDied
            raise
        self.pushed = version

    async def evaluate(self, force: bool = False) -> float | None:
        if not force and self.pushed - self.evaluated < self.config.loop.eval_every:
            return None
        if not self.p.workers.serving():  # the only engine is being replaced: evaluate once its replacement serves
            if not force:
                return None
            while not self.p.workers.serving():
                self.p.workers.check()
                await asyncio.sleep(TICK_S)
        scores = await heldout_scores(self.config, self.p)
        self.accuracy, self.evaluated = record_evaluation(self.p, scores, self.pushed, self.books.elapsed()), self.pushed
        return self.accuracy

    def report(self) -> None:
        self.note_replacements()
        elapsed = max(self.books.elapsed(), 1e-9)
        self.p.display.update({
            "mode": self.config.loop.mode, "step": self.state.version, "steps": self.config.loop.steps,
            "elapsed_s": elapsed, "reward": self.last.get("reward"), "accuracy": self.accuracy,
            "accuracy_before": self.state.eval_before, "staleness": self.last.get("staleness_mean"),
            "rollouts_per_s": self.collected / (time.monotonic() - self.t0 + 1e-9),
            "samples_per_s": self.state.ledger["trained"] / elapsed, "in_flight": len(self.episodes),
            "ahead": self.groups.rollouts, "ledger": self.state.ledger,
        })  # fmt: skip

    # -- parts that die ------------------------------------------------------------------------

    def note_replacements(self) -> None:
        """Record the rollout workers the worker group replaced since the last look."""
        for replaced in self.p.workers.replaced():
            self._recovered({"event": "worker_replaced", **replaced})
            self.p.display.say(f"rollout worker {replaced['engine_id']} died; {replaced['replacement']} serves version "
                               f"{replaced['version']} after {replaced['recovery_s']:.1f} s")  # fmt: skip

    async def restart_learner(self, died: LearnerDied) -> None:
        """A learner that died is restarted from the last checkpoint, the run's commit point, and the run
        goes on as `--resume` would have it: the books go back to that checkpoint's, the episodes in
        flight are aborted, and every rollout not acknowledged (trained by the dead learner since the
        checkpoint, in its lost step, waiting in groups, just aborted) is claimed again, whole groups,
        and trained once by the new learner. Raises `died` when it cannot (no way to reclaim, or
        `LEARNER_RESTARTS` already used)."""
        while True:
            if self.p.reclaim_store is None or self.restarts >= LEARNER_RESTARTS:
                raise died
            self.restarts += 1
            detected_at, began = time.time(), time.monotonic()
            try:
                checkpoint, recovered = await self._restart_learner()
            except LearnerDied as again:
                died = again
                continue
            break
        self._recovered({
            "event": "learner_restarted", "checkpoint": checkpoint, "recovered": recovered, "died": str(died),
            "detected_at": detected_at, "serving_at": time.time(), "recovery_s": time.monotonic() - began,
        })  # fmt: skip
        self.p.display.say(f"the learner died; restarted from {checkpoint or 'the starting policy'} at version "
                           f"{self.state.version}, {recovered} trajectories claimed again")  # fmt: skip

    async def _restart_learner(self) -> tuple[str | None, int]:
        assert self.p.reclaim_store is not None
        self.pending = None  # the step in flight died with the learner; its groups are claimed again below
        await self.episodes.stop()
        latest = self.p.rundir.latest_checkpoint()
        checkpoint, saved = latest if latest else (None, LoopState(eval_before=self.state.eval_before))
        self.books.rewind(saved)
        self.groups = GroupBuffer()
        await self.p.learner.restart(None if checkpoint is None else str(checkpoint))
        await self.push()
        self.evaluated = min(self.evaluated, self.pushed)
        reclaim = self.p.reclaim_store()
        try:
            recovered = await self.recover(reclaim)
        finally:
            reclaim.close()
        return None if checkpoint is None else str(checkpoint), recovered

    def _recovered(self, record: dict) -> None:
        record = {**record, "step": self.state.version}
        self.recoveries.append(record)
        self.p.metrics.record(record)

    # -- the ends of a run ---------------------------------------------------------------------

    async def recover(self, reclaim_store: TrajectoryStore) -> int:
        """Take back what a dead run of this run directory left (`Books.recover`); how many trajectories."""
        return await self.books.recover(reclaim_store, self.groups)

    async def close(self) -> float | None:
        """End with balanced books: finish the learner's step, abort the episodes still running, push
        and evaluate the final weights, count what was never trained as aborted, checkpoint. A learner
        that dies meanwhile is restarted and the run goes on to its end again."""
        while True:
            try:
                return await self._close()
            except LearnerDied as died:
                await self.restart_learner(died)
                await self.run()

    async def _close(self) -> float | None:
        if self.pending is not None:
            await self._finish_step()
        await self.episodes.stop()
        await asyncio.to_thread(abort_running, self.p.store, "the run ended")
        if self.state.version > self.pushed:
            await self.push()
        fresh = self.evaluated == self.pushed and self.accuracy is not None
        accuracy = self.accuracy if fresh else await self.evaluate(force=True)
        await self.collect()
        self.books.book_untrained(self.groups.drain())
        await self.books.checkpoint()
        self.note_replacements()
        return accuracy
