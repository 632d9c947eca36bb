"""The real scheduler loop end to end without Ray: an `RLLearner` and an `EmbeddedEngine` in this
process behind the in-process clients (sched/learners.py, sched/workers.py), the real gateway over
loopback, a SQLite store, a tiny policy. Every rollout must end in exactly one account and be acknowledged in the store."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from loop_helpers import CoinEnv, run_in_process, started
from loop_helpers import run_config as config

from asyncrl.gateway.store import open_store
from asyncrl.sched.rundir import LOOP_STATE_FILE, RunDir


def test_a_sync_run_over_in_process_parts_balances_its_books(tmp_path):
    result = asyncio.run(run_in_process(config(tmp_path, "name=s", "loop.mode=sync", "loop.steps=2"), CoinEnv()))
    state, counts = result["state"], result["counts"]
    steps = [r for r in result["records"] if "loss" in r]  # one record per learner call
    # Sync admits one batch (2 groups x 4) per learner call and nothing is left in flight at the end.
    assert started(counts) == 8 * len(steps) and sum(state.ledger.values()) == started(counts)
    assert state.ledger["aborted"] == 0 and state.ledger["trained"] > 0
    assert counts["acked"] == started(counts) and counts["running"] == counts["pending"] == counts["claimed"] == 0
    assert state.version == 2 and result["versions"] == [2] and result["health"][0]["version"] == 2
    stepped = [r for r in steps if r["stepped"]]
    assert [r["step"] for r in stepped] == [1, 2] and [r["pushed_version"] for r in stepped] == [1, 2]
    assert all(r["staleness_max"] == 0 for r in steps)  # every trained token from the weights being trained
    evals = [r for r in result["records"] if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2] and evals[-1]["eval_accuracy"] == result["eval_after"]
    assert state.eval_before == evals[0]["eval_accuracy"]
    # The last checkpoint (close's, over step 2's) holds the same books, with nothing left to acknowledge.
    saved = json.loads((result["rundir"].checkpoint_dir(2) / LOOP_STATE_FILE).read_text())
    assert saved["version"] == 2 and saved["ledger"] == state.ledger and saved["acking"] == []


def test_an_async_run_over_in_process_parts_balances_its_books(tmp_path):
    run = config(tmp_path, "name=a", "loop.steps=3", "learner.checkpoint_every=1")
    result = asyncio.run(run_in_process(run, CoinEnv(crash_every=3)))
    state, counts = result["state"], result["counts"]
    assert sum(state.ledger.values()) == started(counts) > 0
    assert state.ledger["dropped_crash"] > 0  # the first group's task crashes (seeded); accounted, and the run carries on
    assert counts["acked"] == started(counts) and counts["running"] == counts["pending"] == counts["claimed"] == 0
    assert state.version == 3 and result["versions"] == [3] and result["health"][0]["version"] == 3
    stepped = [r for r in result["records"] if r.get("stepped")]
    assert [r["pushed_version"] for r in stepped] == [1, 2, 3]
    checkpoints = sorted(p.parent.name for p in result["rundir"].checkpoints.glob(f"step-*/{LOOP_STATE_FILE}"))
    assert checkpoints == ["step-000001", "step-000002", "step-000003"]  # one per version (checkpoint_every=1)
    saved = json.loads((result["rundir"].checkpoint_dir(3) / LOOP_STATE_FILE).read_text())
    assert saved["version"] == 3 and saved["ledger"] == state.ledger


class CtrlC(CoinEnv):
    """Presses Ctrl-C at its `press_at`-th episode: cancels the run's main task, as `asyncio.run` does on SIGINT."""

    def __init__(self, press_at: int, main: asyncio.Task) -> None:
        super().__init__()
        self.press_at, self.main = press_at, main

    async def run_episode(self, task: int, client):
        if self.episodes + 1 == self.press_at:
            self.main.cancel()
        return await super().run_episode(task, client)


def test_a_killed_run_resumes_in_process_without_losing_or_retraining_trajectories(tmp_path):
    killed = config(tmp_path, "name=r", "loop.steps=20", "learner.checkpoint_every=1")

    async def until_ctrl_c():
        await run_in_process(killed, CtrlC(press_at=60, main=asyncio.current_task()))

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(until_ctrl_c())
    rundir = RunDir.for_config(killed)
    assert rundir.latest_checkpoint() is not None, "no checkpoint before the stop"
    store = open_store(rundir.store_address(killed), namespace=killed.name)
    left = store.counts()
    store.close()
    assert left["acked"] > 0 and left["pending"] + left["claimed"] > 0  # a stop mid-way
    assert left["running"] == 0  # stopping the episodes aborted their rollouts

    result = asyncio.run(run_in_process(config(tmp_path, "name=r", "loop.steps=7", "learner.checkpoint_every=1"), CoinEnv(), resume=True))
    state, counts = result["state"], result["counts"]
    # Everything the dead run did not acknowledge is claimed again, and nothing it did.
    assert result["recovered"] == left["pending"] + left["claimed"]
    assert sum(state.ledger.values()) == started(counts) and counts["acked"] == started(counts)
    assert counts["running"] == counts["pending"] == counts["claimed"] == 0
    assert state.version == 7 and result["versions"] == [7]


class NoRewardEnv(CoinEnv):
    """Rewards nothing, so no group has an advantage and no batch steps; a Ctrl-C once `batches` batches
    have come back without a step."""

    def __init__(self, metrics, batches: int) -> None:
        super().__init__()
        self.metrics, self.batches = metrics, batches

    async def run_episode(self, task, client):
        records = [json.loads(line) for line in self.metrics.read_text().splitlines()] if self.metrics.exists() else []
        if sum(1 for r in records if r.get("stepped") is False) >= self.batches:
            raise KeyboardInterrupt
        result = await super().run_episode(task, client)
        return dataclasses.replace(result, reward=0.0)


def test_a_run_whose_batches_never_step_says_why(tmp_path, capsys):
    from asyncrl.sched.steps import NO_SIGNAL_BATCHES

    env = NoRewardEnv(tmp_path / "quiet" / "metrics.jsonl", NO_SIGNAL_BATCHES + 2)
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(run_in_process(config(tmp_path, "name=quiet", "loop.steps=5"), env))
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("no optimizer step")]
    assert len(said) == 1 and said[0].startswith(f"no optimizer step for {NO_SIGNAL_BATCHES} batches in a row: in the last one 8 rollouts")
    assert "mean reward 0.000" in said[0] and "0 were dropped" in said[0]


class FlatEnv(CoinEnv):
    """Rewards every rollout alike, so no group has an advantage."""

    async def run_episode(self, task, client):
        return dataclasses.replace(await super().run_episode(task, client), reward=0.0)


def test_a_run_whose_batches_never_step_stops_after_max_batches_without_step(tmp_path):
    run = config(tmp_path, "name=flat", "loop.mode=sync", "loop.steps=5", "loop.max_batches_without_step=3")
    result = asyncio.run(run_in_process(run, FlatEnv()))
    state, counts = result["state"], result["counts"]
    batches = [r for r in result["records"] if "loss" in r]
    assert result["stop_reason"] == "no_signal" and state.version == 0
    assert len(batches) == 3 and not any(r["stepped"] for r in batches)  # nothing admitted once it holds
    assert state.ledger["aborted"] == 0 and sum(state.ledger.values()) == started(counts) == counts["acked"]


def test_the_no_step_notice_comes_at_ten_batches_then_every_hundred():
    from asyncrl.sched.steps import no_signal_notice

    said = [n for n in range(1, 1001) if no_signal_notice(n, {"reward": 1.0, "skipped_zero_adv": 8, "ledger": {}})]
    assert said == [10, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]


class HalfFlatEnv(CoinEnv):
    """Every other training group's task is odd and rewards every rollout alike (no signal); even tasks reward
    the parity of the reply."""

    drawn = 0

    def sample_task(self, rng, split="train") -> int:
        self.drawn += split == "train"
        return 2 * super().sample_task(rng, split) + (split == "train" and self.drawn % 2)

    async def run_episode(self, task, client):
        result = await super().run_episode(task, client)
        return dataclasses.replace(result, reward=1.0) if task % 2 else result


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dynamic_sampling_drops_groups_without_signal_and_admits_more(tmp_path, mode):
    run = config(tmp_path, f"name=ds-{mode}", f"loop.mode={mode}", "loop.steps=3", "learner.dynamic_sampling.enabled=true")
    result = asyncio.run(run_in_process(run, HalfFlatEnv()))
    state, counts = result["state"], result["counts"]
    assert state.version == 3 and state.ledger["dropped_no_signal"] > 0
    assert sum(state.ledger.values()) == started(counts) == counts["acked"]
    steps = [r for r in result["records"] if "loss" in r]
    # A trained batch holds no all-equal group once they are dropped: every sample has an advantage.
    assert all(r["skipped_zero_adv"] == 0 for r in steps)
    assert steps[-1]["dropped_no_signal_groups"] * 4 == state.ledger["dropped_no_signal"]


def test_dynamic_sampling_stops_dropping_at_its_cap_so_a_flat_task_cannot_stall_the_run(tmp_path):
    run = config(tmp_path, "name=ds-flat", "loop.mode=sync", "loop.steps=5", "loop.max_batches_without_step=2",
                 "learner.dynamic_sampling.enabled=true", "learner.dynamic_sampling.max_dropped=1")  # fmt: skip
    result = asyncio.run(run_in_process(run, FlatEnv()))
    state = result["state"]
    batches = [r for r in result["records"] if "loss" in r]
    # 2 groups dropped (1 x batch_groups) before each batch, then a batch of flat groups is trained.
    assert result["stop_reason"] == "no_signal" and len(batches) == 2
    assert state.ledger["dropped_no_signal"] == 2 * 2 * 4 and state.ledger["trained"] == 2 * 2 * 4
