"""A learner that dies mid-run (sched/recovery.py), without Ray: the real loop over in-process parts
whose learner client raises `LearnerDied` as `RayLearner` does once its actor is gone. The loop
restarts it from the last checkpoint, claims again what that checkpoint had not acknowledged, and
finishes with every rollout in exactly one account; past `LEARNER_RESTARTS` deaths the run ends."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from loop_helpers import CoinEnv, started
from loop_helpers import run_config as config

from asyncrl.gateway.serving import InProcessGateway, episode_http_client
from asyncrl.gateway.store import open_store
from asyncrl.learner.rl import RLLearner
from asyncrl.policy.checkpoint import build_policy
from asyncrl.rollout.engine import EmbeddedEngine
from asyncrl.sched.display import Display
from asyncrl.sched.learners import LocalLearner
from asyncrl.sched.loop import Loop
from asyncrl.sched.parts import LearnerDied, Parts
from asyncrl.sched.recovery import LEARNER_RESTARTS
from asyncrl.sched.rundir import LoopState, RunDir
from asyncrl.sched.supervision import Unsupervised
from asyncrl.sched.tasks import TaskMix
from asyncrl.sched.workers import LocalWorkers


class MortalLearner(LocalLearner):
    """Dies at the first train step once `dies()` holds, `times` times at most (None: at every such
    step): that step and every call after it raise LearnerDied, and nothing of the step is applied,
    until `restart` loads a checkpoint. `deaths` counts them."""

    def __init__(self, learner: RLLearner, dies: Callable[[], bool], times: int | None) -> None:
        super().__init__(learner)
        self.dies, self.times, self.dead, self.deaths = dies, times, False, 0

    async def train_step(self, batch):
        if not self.dead and self.deaths != self.times and self.dies():
            self.dead, self.deaths = True, self.deaths + 1
        await self.check()
        return await super().train_step(batch)

    async def weights(self):
        await self.check()
        return await super().weights()

    async def save(self, directory: str) -> None:
        await self.check()
        await super().save(directory)

    async def check(self) -> None:
        if self.dead:
            raise LearnerDied("the learner died (a test's)")

    async def restart(self, checkpoint: str | None) -> None:
        await super().restart(checkpoint)
        self.dead = False


async def run_with_mortal_learner(run, dies: Callable[[RunDir, RLLearner], bool], times: int | None) -> dict:
    """The loop of `asyncrl run` over in-process parts, its learner a MortalLearner, and a reclaim store
    (as `asyncrl/jobs/run.py` gives it); the result holds the loop, the learner, the store's counts and the
    metrics, or the error the run ended with."""
    rundir = RunDir.for_config(run)
    rundir.write_config(run)
    address = rundir.store_address(run)
    store, state = open_store(address, namespace=run.name), LoopState()
    model, tokenizer, _ = build_policy(run.policy, run.seed)
    workers = LocalWorkers([EmbeddedEngine(model, run.rollout, engine_id="local-0")])
    policy = RLLearner.from_config(run)
    learner = MortalLearner(policy, lambda: dies(rundir, policy), times)
    metrics, result = rundir.metrics(run, resume=False), {"state": state, "learner": learner, "error": None}
    try:
        async with InProcessGateway(run, store, workers.engines, tokenizer) as gateway, episode_http_client(run, gateway) as http:
            parts = Parts(
                store=store, gateway=gateway, http=http, tasks=TaskMix.from_config(run, CoinEnv()), learner=learner,
                workers=workers, supervision=Unsupervised(len(workers.engines)), tokenizer=tokenizer, rundir=rundir,
                metrics=metrics, display=Display(progress=False),
                reclaim_store=lambda: open_store(address, namespace=run.name, visibility_timeout_s=1e-6),
            )  # fmt: skip
            loop = result["loop"] = Loop(run, parts, state)
            try:
                await loop.push()
                await loop.evaluate_first()
                await loop.run()
                result["eval_after"] = await loop.close()
            except LearnerDied as error:
                result["error"] = error
            finally:
                await loop.episodes.stop()
        result.update(counts=store.counts(), versions=await workers.versions(), records=metrics.read())
    finally:
        metrics.close()
        store.close()
    return result


def checkpointed(rundir: RunDir, learner: RLLearner) -> bool:
    return rundir.latest_checkpoint() is not None


def past_a_checkpoint(rundir: RunDir, learner: RLLearner) -> bool:
    """A checkpoint exists and the learner has stepped since: that step's books are not committed."""
    latest = rundir.latest_checkpoint()
    return latest is not None and learner.version > latest[1].version


def test_a_learner_that_dies_restarts_from_the_last_checkpoint_and_the_books_balance(tmp_path):
    run = config(tmp_path, "name=k", "loop.steps=5", "learner.checkpoint_every=2")
    result = asyncio.run(run_with_mortal_learner(run, dies=past_a_checkpoint, times=1))
    state, counts, loop = result["state"], result["counts"], result["loop"]
    assert result["error"] is None and result["learner"].deaths == 1
    (restarted,) = loop.recoveries
    assert restarted["event"] == "learner_restarted" and restarted["checkpoint"].endswith("step-000002")
    assert restarted["step"] == 2  # the books went back to the checkpoint's version
    # Step 3's batch (2 groups x 4, booked but not acknowledged) and the lost step's are claimed again.
    assert restarted["recovered"] >= 16 and restarted["serving_at"] >= restarted["detected_at"]
    assert [r for r in result["records"] if r.get("event") == "learner_restarted"] == [restarted]
    # The run goes on to its end: every rollout in exactly one account (step 3's not twice), acknowledged once.
    assert state.version == 5 and result["versions"] == [5]
    assert sum(state.ledger.values()) == started(counts) == counts["acked"]
    assert counts["running"] == counts["pending"] == counts["claimed"] == 0


def test_a_learner_that_keeps_dying_ends_the_run_after_the_last_restart(tmp_path):
    run = config(tmp_path, "name=d", "loop.steps=50", "learner.checkpoint_every=1")
    result = asyncio.run(run_with_mortal_learner(run, dies=checkpointed, times=None))
    loop = result["loop"]
    assert isinstance(result["error"], LearnerDied) and result["learner"].deaths == LEARNER_RESTARTS + 1
    assert [r["event"] for r in loop.recoveries] == ["learner_restarted"] * LEARNER_RESTARTS
    # Each restart went back to the one checkpoint there is, and its learner died at its first step.
    assert loop.recovery.restarts == LEARNER_RESTARTS and result["state"].version == 1
