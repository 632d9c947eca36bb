"""`eval.engine: own`: the loop's periodic evaluations play on an engine of their own while training goes
on, and are booked at the version they evaluated; `shared` evaluations hold training (sched/evaluation.py).

Whether training goes on is read from the loop itself, not from a clock: each periodic evaluation's
episodes wait until the learner has taken two more steps (or the run closes, or a guard time passes),
and note how many it took meanwhile. Between pushes on the serving engines the loop is inside the
evaluation, so none can be taken there: those episodes give up after a short wait, having seen none.
"""

from __future__ import annotations

import asyncio
import itertools

from loop_helpers import CoinEnv, run_config, run_in_process, started

from asyncrl.sched.loop import Loop
from asyncrl.sched.workers import LocalEvaluationEngine


class WatchingEnv(CoinEnv):
    """CoinEnv whose held-out episodes (negative tasks) wait for the learner's progress during the RL
    phase, up to `patience_s`, and record the steps they saw taken while they waited."""

    def __init__(self, patience_s: float) -> None:
        super().__init__()
        self.patience_s, self.loop, self.progress = patience_s, None, []

    def watch(self, loop: Loop) -> None:
        self.loop = loop

    def sample_task(self, rng, split="train") -> int:
        task = super().sample_task(rng, split)
        return -task - 1 if split == "eval" else task

    async def run_episode(self, task: int, client):
        loop = self.loop
        if task < 0 and loop is not None and loop.state.version > 0 and not loop.flight.closing:
            began = loop.state.version
            waited = 0.0
            while loop.state.version < began + 2 and not loop.flight.closing and waited < self.patience_s:
                await asyncio.sleep(0.02)
                waited += 0.02
            self.progress.append(loop.state.version - began)
        return await super().run_episode(abs(task), client)


def _evaluations(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("eval_accuracy") is not None]


def test_own_engine_evaluates_while_training_goes_on(tmp_path):
    config = run_config(tmp_path, "eval.engine=own", "loop.steps=8", "loop.eval_every=2", "learner.max_staleness=1")
    env = WatchingEnv(patience_s=120.0)  # a guard only: training that goes on takes two steps in seconds
    result = asyncio.run(run_in_process(config, env, on_loop=env.watch))

    assert env.progress and max(env.progress) >= 2  # steps were taken while evaluation episodes played
    evals = _evaluations(result["records"])
    engines = [r["eval_engine"] for r in evals]
    aside = [r for r in evals if r["eval_engine"] == "own"]
    versions = [r["step"] for r in aside]
    # The first, of the starting weights, plays beside the first steps and is the run's starting figure.
    assert evals[0]["eval_engine"] == "own" and versions[0] == 0 and result["state"].eval_before == evals[0]["eval_accuracy"]
    # Each later one begins at a push that made one due (eval_every=2 versions after the last), one at a time.
    assert len(versions) >= 2 and all(later - earlier >= 2 for earlier, later in itertools.pairwise(versions)), engines
    assert evals[-1]["step"] == result["state"].version  # the final weights were evaluated
    assert sum(result["state"].ledger.values()) == started(result["counts"])


def test_shared_engines_hold_training_during_evaluation(tmp_path):
    config = run_config(tmp_path, "loop.steps=4", "loop.eval_every=2")
    env = WatchingEnv(patience_s=1.0)
    result = asyncio.run(run_in_process(config, env, on_loop=env.watch))

    assert env.progress and set(env.progress) == {0}  # the loop was inside the evaluation: no step could be booked
    assert {r["eval_engine"] for r in _evaluations(result["records"])} == {"shared"}


def test_a_failing_evaluation_engine_falls_back_to_the_shared_engines(tmp_path, monkeypatch):
    async def broken(self, weights, version):
        raise RuntimeError("the evaluation engine is gone")

    monkeypatch.setattr(LocalEvaluationEngine, "load", broken)
    config = run_config(tmp_path, "eval.engine=own", "loop.steps=4", "loop.eval_every=2")
    result = asyncio.run(run_in_process(config, CoinEnv()))

    assert result["stop_reason"] == "steps"
    assert {r["eval_engine"] for r in _evaluations(result["records"])} == {"shared"}
    assert result["eval_after"] is not None
    assert sum(result["state"].ledger.values()) == started(result["counts"])


def test_eval_every_s_makes_an_evaluation_due_by_the_runs_time_too(tmp_path):
    # By versions alone (eval_every 1000) only the first and the last weights are evaluated; with a cadence of a
    # microsecond every new version the loop serves is due, whatever the machine's speed.
    by_versions = run_config(tmp_path, "name=v", "loop.steps=4", "loop.eval_every=1000")
    by_time = run_config(tmp_path, "name=t", "loop.steps=4", "loop.eval_every=1000", "loop.eval_every_s=1e-6")
    versions = {
        name: [r["step"] for r in _evaluations(asyncio.run(run_in_process(config, CoinEnv()))["records"])]
        for name, config in (("versions", by_versions), ("time", by_time))
    }
    assert versions["versions"] == [0, 4]
    assert versions["time"][0] == 0 and versions["time"][-1] == 4 and len(versions["time"]) > 2
    assert versions["time"] == sorted(set(versions["time"]))  # each a version not evaluated before
