"""The scheduler loop: a few named verbs, repeated until the learner has taken `run.steps` steps.

    admit     start GRPO groups of episodes while the in-flight and staleness bounds allow, each
              group's task picked by the task mix (shares and rate limits: `sched/tasks.py`)
    collect   claim finished trajectories (aborted ones too) from the store into their groups
    train     hand complete groups to the learner (a Ray call: episodes keep running meanwhile), scored
              by their stages' teachers first in a distillation run (distill/);
              when the step returns, book its ledger, push weights when due, checkpoint when due
    evaluate  each task's held-out greedy success on the rollout workers, every `run.eval_every`
              versions (the environments' own episodes, recorded nowhere: `envs/evaluation.py`)
    report    the live display

Async and sync runs are this same loop with a different admission rule (`groups_to_admit`). Async
admits while fewer than `run.max_inflight` episodes run and the rollouts ahead of the learner would
still be at most tau (`learner.max_staleness`) versions old when their batch is trained; sync admits
one batch only when nothing is ahead and the learner is idle, so it alternates generate, train, push.

Trajectories are acknowledged in the store only when a checkpoint that holds their training is on
disk (`checkpoint`), so a run that dies loses nothing and re-trains nothing: on resume, whatever
was not acknowledged is claimed again (`recover`). Every rollout ends in one account of the ledger.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass

from asyncrl.configs.schema import RunConfig
from asyncrl.envs.evaluation import AsyncGenerateFn, evaluate_env
from asyncrl.envs.runner import run_recorded_episode
from asyncrl.gateway.store import RolloutClosed
from asyncrl.learner.publish import push_weights
from asyncrl.records import TERMINAL_STATUSES

from .groups import Group, GroupBuffer, group_samples
from .rundir import LoopState
from .tasks import TaskMix

CONSUMER = "learner"
"""The store consumer name the loop claims and acknowledges trajectories under."""
TICK_S = 0.05
"""Pause between rounds of the loop; episodes and the learner run on without it."""


@dataclass
class Parts:
    """What the loop drives; `sched/run.py` builds them."""

    store: object  # TrajectoryStore
    gateway: object  # the lifecycle client (sched/lifecycle.py)
    http: object  # the HTTP client (openai.DefaultAioHttpClient) shared by every episode's OpenAI client
    tasks: TaskMix
    learner: object  # LearnerActor handle
    workers: list
    tokenizer: object
    rundir: object  # RunDir
    metrics: object  # MetricsLog
    display: object  # Display
    teachers: object = None  # distill.Teachers: a distillation run's teachers score every batch first; None in RL


class Loop:
    def __init__(self, config: RunConfig, parts: Parts, state: LoopState) -> None:
        self.config, self.p, self.state = config, parts, state
        self.group_size, self.batch_groups = config.learner.group_size, config.learner.batch_groups
        self.groups = GroupBuffer()
        self.episodes: set[asyncio.Task] = set()
        self.failures: list[BaseException] = []
        self.pending: tuple[asyncio.Future, list[Group]] | None = None  # the learner step in flight
        self.pushed = self.evaluated = state.version  # version the workers serve / last evaluated
        self.unacked: list[str] = []  # accounted since the last checkpoint
        self.seen: set[str] = set()  # a lease that expires comes back once more; never count it twice
        self.rng = random.Random(f"{config.seed}-{state.version}")
        self.started_at = self.t0 = time.monotonic()  # started_at: since the last checkpoint's wall count
        self.collected = 0
        self.last: dict = {}
        self.accuracy = state.eval_before

    async def run(self) -> None:
        while not self.finished():
            self.admit()
            await self.collect()
            await self.train()
            await self.evaluate()
            self.report()
            await asyncio.sleep(TICK_S)

    def finished(self) -> bool:
        return self.state.version >= self.config.run.steps or self.out_of_time()

    def out_of_time(self) -> bool:
        budget = self.config.run.wall_budget_s
        return budget is not None and self.state.rl_wall_s + time.monotonic() - self.started_at >= budget

    # -- admit --------------------------------------------------------------------------------

    def groups_to_admit(self) -> int:
        """How many GRPO groups may start now."""
        run, g = self.config.run, self.group_size
        ahead = self.groups.rollouts  # admitted, not yet handed to the learner
        if self.state.version + (self.pending is not None) >= run.steps or self.out_of_time():
            return 0  # the steps left are covered already
        if run.mode == "sync":
            return self.batch_groups if self.pending is None and ahead == 0 else 0
        # A rollout admitted now reaches the learner behind `ahead` others, i.e. ~ahead / batch steps
        # from now, and the learner is already `lag` versions past the weights it samples with.
        lag = self.state.version + (self.pending is not None) - self.pushed
        fresh = self.batch_groups * g * (self.config.learner.max_staleness + 1 - lag) - ahead
        room = run.max_inflight - len(self.episodes)
        return max(0, min(fresh, room) // g)

    def admit(self) -> None:
        if self.failures:
            raise RuntimeError(f"an episode could not start: {self.failures[0]!r}") from self.failures[0]
        for _ in range(self.groups_to_admit()):
            task = self.p.tasks.pick()
            if task is None:
                return  # every task is at its rate limit
            problem, group_id = task.env.sample_task(self.rng, "train"), uuid.uuid4().hex[:16]
            self.groups.open(group_id, self.group_size)
            for _ in range(self.group_size):
                episode = run_recorded_episode(
                    task.env, problem, self.p.gateway, group_id=group_id, timeout_s=self.config.run.episode_timeout_s,
                    metadata={"admitted_at_version": self.pushed}, http_client=self.p.http,
                    sandboxes=task.sandboxes, task_name=task.name,
                )  # fmt: skip
                running = asyncio.create_task(episode)
                self.episodes.add(running)
                running.add_done_callback(self._episode_done)

    def _episode_done(self, task: asyncio.Task) -> None:
        self.episodes.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.failures.append(task.exception())  # the gateway refused to open a rollout

    # -- collect ------------------------------------------------------------------------------

    async def collect(self) -> None:
        claim_batch = self.config.store.claim_batch
        while True:
            claimed = await asyncio.to_thread(self.p.store.claim, CONSUMER, claim_batch)
            for trajectory in claimed:
                if trajectory.rollout_id not in self.seen:
                    self.seen.add(trajectory.rollout_id)
                    self.groups.add(trajectory)
                    self.collected += 1
            if len(claimed) < claim_batch:
                return

    # -- train --------------------------------------------------------------------------------

    async def train(self) -> None:
        if self.pending is not None and self.pending[0].done():
            future, groups = self.pending
            self.pending = None
            await self._book_step(future.result(), groups)
        if self.pending is None and self.groups.ready >= self.batch_groups and not self.finished():
            groups = self.groups.take(self.batch_groups)
            samples = group_samples(groups, self.config.learner.crash_statuses)
            self.pending = asyncio.ensure_future(self._learn(samples)), groups

    async def _learn(self, samples: list) -> dict:
        """One learner step; in distillation the teachers score the samples first (their metrics join the step's)."""
        scored = {}
        if self.p.teachers is not None:
            samples, scored = await self.p.teachers.score(samples)
        metrics = await asyncio.wrap_future(self.p.learner.train_step.remote(samples).future())
        return {**metrics, **scored}

    async def _book_step(self, metrics: dict, groups: list[Group]) -> None:
        rollout_ids = [t.rollout_id for group in groups for t in group.trajectories]
        if sum(metrics["ledger"].values()) != len(rollout_ids):
            raise RuntimeError(f"the learner accounted for {sum(metrics['ledger'].values())} of {len(rollout_ids)} rollouts")
        for account, n in metrics["ledger"].items():
            self.state.ledger[account] += n
        self.unacked += rollout_ids
        before, self.state.version = self.state.version, metrics["version"]
        if metrics["push_due"]:
            await self.push()
        if self.state.version // self.config.learner.checkpoint_every > before // self.config.learner.checkpoint_every:
            await self.checkpoint()
        rewards = [t.reward for group in groups for t in group.trajectories if t.status != "aborted"]
        lags = metrics.pop("staleness")
        self.last = {
            "step": self.state.version, "elapsed_s": self.elapsed(), "reward": sum(rewards) / max(len(rewards), 1),
            "staleness_mean": sum(int(k) * v for k, v in lags.items()) / max(sum(lags.values()), 1),
            "staleness_max": max(map(int, lags), default=0), "pushed_version": self.pushed,
            "in_flight": len(self.episodes), "ahead": self.groups.rollouts, **metrics,
        }  # fmt: skip
        self.p.metrics.record(self.last)

    async def push(self) -> None:
        """Weights to every engine; the loop waits (no admission meanwhile), the episodes do not."""
        version = self.state.version
        await asyncio.to_thread(push_weights, self.p.workers, self.p.learner.state.remote(), version)
        self.pushed = version

    async def checkpoint(self) -> None:
        """Save the learner, then acknowledge what it trained (the loop state lists them first, so a
        crash between the two is finished on resume: `recover` acknowledges `acking`)."""
        directory = self.p.rundir.checkpoint_dir(self.state.version)
        await self.p.learner.save.remote(str(directory))
        self.state.rl_wall_s += time.monotonic() - self.started_at
        self.started_at = time.monotonic()
        self.state.acking = list(self.unacked)
        self.p.rundir.commit_checkpoint(directory, self.state)
        await asyncio.to_thread(self.p.store.ack, CONSUMER, self.unacked)
        self.unacked = []

    # -- the ends of a run ---------------------------------------------------------------------

    async def recover(self, reclaim_store) -> int:
        """Take back what a dead run left: abort its running rollouts, claim every trajectory it did not
        acknowledge (`reclaim_store` is this store with no visibility timeout: the dead run's leases
        count as expired), finish the acknowledgement its last checkpoint began, group the rest."""
        await asyncio.to_thread(abort_running, self.p.store, "the run stopped before this rollout ended")
        total = sum(self.p.store.counts()[status] for status in TERMINAL_STATUSES)
        left = await asyncio.to_thread(reclaim_store.claim, CONSUMER, max(total, 1)) if total else []
        await asyncio.to_thread(self.p.store.ack, CONSUMER, self.state.acking)
        acked, by_group = set(self.state.acking), defaultdict(list)
        for trajectory in left:
            if trajectory.rollout_id not in acked:
                by_group[trajectory.group_id].append(trajectory)
        for group_id, members in by_group.items():  # whole groups: a checkpoint acknowledges groups whole
            self.groups.open(group_id, len(members))
            for trajectory in members:
                self.seen.add(trajectory.rollout_id)
                self.groups.add(trajectory)
        return sum(map(len, by_group.values()))

    async def close(self) -> float | None:
        """End with balanced books: finish the learner's step, abort the episodes still running, push
        and evaluate the final weights, count what was never trained as aborted, checkpoint."""
        if self.pending is not None:
            future, groups = self.pending
            self.pending = None
            await self._book_step(await future, groups)
        await self.stop_episodes()
        await asyncio.to_thread(abort_running, self.p.store, "the run ended")
        if self.state.version > self.pushed:
            await self.push()
        accuracy = self.accuracy if self.evaluated == self.pushed and self.accuracy is not None else None
        accuracy = accuracy if accuracy is not None else await self.evaluate(force=True)
        await self.collect()
        leftovers = self.groups.drain()
        self.state.ledger["aborted"] += len(leftovers)
        self.unacked += [t.rollout_id for t in leftovers]
        await self.checkpoint()
        return accuracy

    async def stop_episodes(self) -> None:
        running = list(self.episodes)
        for task in running:
            task.cancel()  # the runner aborts its rollout through the gateway
        await asyncio.gather(*running, return_exceptions=True)

    # -- evaluate and report ------------------------------------------------------------------

    async def evaluate(self, force: bool = False) -> float | None:
        if not force and self.pushed - self.evaluated < self.config.run.eval_every:
            return None
        generate, config = workers_greedy_generate(self.p.workers), self.config
        scores = {}
        for task, num_problems in self.p.tasks.evaluated(config.eval.num_problems):
            result = await evaluate_env(
                task.env, generate, self.p.tokenizer, num_problems=num_problems, seed=config.eval.seed,
                sandboxes=task.sandboxes, default_max_tokens=config.eval.max_tokens, timeout_s=config.run.episode_timeout_s,
            )  # fmt: skip
            scores[task.name] = result.accuracy
        # One number for the display and summary: the tasks weigh equally, whatever their shares.
        self.accuracy, self.evaluated = sum(scores.values()) / len(scores) if scores else None, self.pushed
        per_task = {f"eval_accuracy/{name}": value for name, value in scores.items()} if len(scores) > 1 else {}
        self.p.metrics.record({"step": self.pushed, "eval_accuracy": self.accuracy, **per_task, "elapsed_s": self.elapsed()})
        shown = "  ".join(f"{name} {value:.1%}" for name, value in scores.items())
        self.p.display.say(f"version {self.pushed}  {self.elapsed():6.0f}s  held-out accuracy {shown}")
        return self.accuracy

    def elapsed(self) -> float:
        return self.state.rl_wall_s + time.monotonic() - self.started_at

    def report(self) -> None:
        elapsed = max(self.elapsed(), 1e-9)
        self.p.display.update({
            "mode": self.config.run.mode, "step": self.state.version, "steps": self.config.run.steps,
            "elapsed_s": elapsed, "reward": self.last.get("reward"), "accuracy": self.accuracy,
            "accuracy_before": self.state.eval_before, "staleness": self.last.get("staleness_mean"),
            "rollouts_per_s": self.collected / (time.monotonic() - self.t0 + 1e-9),
            "samples_per_s": self.state.ledger["trained"] / elapsed, "in_flight": len(self.episodes),
            "ahead": self.groups.rollouts, "ledger": self.state.ledger,
        })  # fmt: skip


def abort_running(store, reason: str) -> int:
    """Abort every rollout the store still holds as running (episodes the run no longer drives)."""
    running = store.list(status="running")
    for trajectory in running:
        try:
            store.abort(trajectory.rollout_id, reason)
        except RolloutClosed:
            pass  # it ended on its own meanwhile
    return len(running)


def workers_greedy_generate(workers: list) -> AsyncGenerateFn:
    """Greedy decoding on the rollout workers, requests spread round-robin (each worker batches what
    it is sent at once)."""
    turn = itertools.count()

    async def generate(prompt: list[int], max_tokens: int) -> list[int]:
        worker = workers[next(turn) % len(workers)]
        result = await asyncio.wrap_future(worker.generate.remote(prompt, {"temperature": 0.0, "max_tokens": max_tokens}).future())
        return result.token_ids

    return generate
