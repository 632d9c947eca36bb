"""The scheduler loop end to end: real Ray actors (rollout worker, learner), the real gateway over
loopback, a SQLite store, a tiny policy. Async, sync, a crashing environment, and a run killed
mid-way then resumed; every run's ledger must balance (each rollout in exactly one account)."""

from __future__ import annotations

import json

import pytest
from loop_helpers import TINY, CoinEnv

from asyncrl.configs.loader import load_config
from asyncrl.gateway.store import open_store

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # Ray (~4 s) plus a worker and a learner process per run


def config(tmp_path, *overrides: str):
    return load_config("quickstart", [*TINY, f"runs_dir={tmp_path}", *overrides])


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_ledger(summary: dict) -> None:
    ledger = dict(summary["ledger"])
    started = ledger.pop("started")
    assert summary["balanced"] and sum(ledger.values()) == started > 0, summary


def test_async_run_pushes_weights_and_survives_a_crashing_environment(ray_session, tmp_path):
    from asyncrl.jobs.run import run

    summary = run(config(tmp_path, "name=a", "loop.steps=3"), env=CoinEnv(crash_every=3))
    check_ledger(summary)
    assert summary["version"] == 3 and summary["engine_versions"] == [3]
    assert summary["ledger"]["trained"] > 0 and summary["ledger"]["dropped_crash"] > 0
    run_dir = tmp_path / "a"
    steps = [r for r in read_metrics(run_dir) if r.get("stepped")]  # a batch with no signal takes no step
    assert [r["pushed_version"] for r in steps] == [1, 2, 3]
    store = open_store(run_dir)
    versions = {v for t in store.list() for turn in t.turns for v in turn.versions}
    assert max(versions) >= 1 and 0 in versions  # tokens carry the version that sampled them
    assert store.list(status="env_crash")  # recorded, accounted, and the run carried on
    assert (run_dir / "curves.png").exists() and (run_dir / "checkpoints" / "step-000003" / "loop_state.json").exists()
    assert json.loads((run_dir / "summary.json").read_text())["eval_after"] is not None
    # Where the RL phase's time went: every process used CPU, and the engine stepped part of the time.
    usage = summary["usage"]
    assert usage["wall_s"] > 0 and set(usage["cpu_s"]) == {"driver", "learner", "engine:a-rollout-0"}
    assert all(seconds > 0 for seconds in usage["cpu_s"].values())
    assert 0 < usage["engine_busy_frac"]["a-rollout-0"] <= 1


def test_a_run_evaluates_on_an_engine_of_its_own_over_ray(ray_session, tmp_path):
    """eval.engine=own with Ray: a RolloutWorker of its own (reserving no CPU) plays every evaluation, the
    first included, while the loop trains; the run ends with balanced books."""
    from asyncrl.jobs.run import run

    summary = run(config(tmp_path, "name=e", "loop.steps=4", "loop.eval_every=2", "eval.engine=own"), env=CoinEnv())
    check_ledger(summary)
    evals = [r for r in read_metrics(tmp_path / "e") if r.get("eval_accuracy") is not None]
    assert evals[0]["step"] == 0 and evals[0]["eval_engine"] == "own" and evals[0]["eval_failed/coin"] == 0
    assert summary["eval_before"] == evals[0]["eval_accuracy"] and evals[-1]["step"] == summary["version"] == 4
    assert summary["eval_after"] == evals[-1]["eval_accuracy"]


def test_a_run_with_gateway_replicas_opens_rollouts_on_each_and_records_them_all(ray_session, tmp_path):
    """gateway.replicas=2: the driver's gateway and a replica actor each open every other rollout and serve
    its calls (episodes call the replica over HTTP), over the one store and the same engine."""
    from asyncrl.gateway.replicas import home_of
    from asyncrl.jobs.run import run

    summary = run(config(tmp_path, "name=r", "gateway.replicas=2", "loop.steps=2"), env=CoinEnv())
    check_ledger(summary)
    assert summary["version"] == 2 and summary["engine_versions"] == [2]
    opened = summary["gateway_replicas"]["opened"]
    assert set(opened) == {"g0", "g1"} and abs(opened["g0"] - opened["g1"]) <= 1  # in turn
    assert summary["gateway_replicas"]["lost"] == [] and summary["usage"]["cpu_s"]["gateway:g1"] > 0
    trajectories = open_store(tmp_path / "r").list()
    homes = {home_of(t.rollout_id) for t in trajectories}
    assert homes == {"g0", "g1"} and all(t.turns for t in trajectories if t.status == "ok")
    assert {turn.engine_id for t in trajectories for turn in t.turns} == {"r-rollout-0"}
    assert not open_store(tmp_path / "r").replicas()  # both withdrew at the end


class ReplicaLossEnv(CoinEnv):
    """CoinEnv that kills the run's replica actor `replica` (as a crash would: no clean-up) in its `at`-th episode."""

    def __init__(self, replica: str, at: int) -> None:
        super().__init__()
        self.replica, self.at = replica, at

    async def run_episode(self, task, client):
        if self.episodes + 1 == self.at:
            ray.kill(ray.get_actor(self.replica))
        return await super().run_episode(task, client)


@pytest.mark.chaos
def test_a_run_whose_gateway_replica_dies_goes_on_through_the_others(ray_session, tmp_path):
    """The replica's rollouts in flight end in one account each (finished or aborted through the driver's
    gateway, which acts on the store alone), and rollouts are opened on the driver's gateway from then on."""
    from asyncrl.jobs.run import run

    summary = run(config(tmp_path, "name=k", "gateway.replicas=2", "loop.steps=4"), env=ReplicaLossEnv("k-gateway-g1", at=40))
    check_ledger(summary)
    assert summary["version"] == 4
    opened = summary["gateway_replicas"]["opened"]
    assert 0 < opened["g1"] < opened["g0"] - 10  # none opened there after the kill
    assert summary["gateway_replicas"]["lost"] == ["g1"]
    (lost,) = [r for r in read_metrics(tmp_path / "k") if r.get("event") == "gateway_replica_lost"]
    assert lost["replica"] == "g1" and lost["reason"]
    store = open_store(tmp_path / "k")
    assert store.counts()["running"] == 0 and store.counts()["acked"] == summary["ledger"]["started"]


def test_sync_run_trains_on_policy(ray_session, tmp_path):
    from asyncrl.jobs.run import run

    summary = run(config(tmp_path, "name=s", "loop.mode=sync", "loop.steps=2"), env=CoinEnv())
    check_ledger(summary)
    assert summary["version"] == 2 and summary["engine_versions"] == [2]
    steps = [r for r in read_metrics(tmp_path / "s") if "loss" in r]
    # Generate, then train, then push: every trained token came from the weights being trained.
    assert all(r["staleness_max"] == 0 for r in steps)
    assert summary["ledger"]["aborted"] == 0  # nothing was in flight or waiting when the run ended


def test_a_killed_run_resumes_without_losing_or_retraining_trajectories(ray_session, tmp_path):
    from asyncrl.jobs.run import run

    run_dir = tmp_path / "r"
    checkpointed = lambda: any((run_dir / "checkpoints").glob("step-*/loop_state.json"))  # noqa: E731
    with pytest.raises(KeyboardInterrupt):  # a Ctrl-C once a checkpoint exists, however long the first step takes
        run(config(tmp_path, "name=r", "loop.steps=20", "learner.checkpoint_every=1"), env=CoinEnv(stop_when=checkpointed))
    store = open_store(run_dir)
    counts = store.counts()
    store.close()
    assert counts["acked"] > 0 and counts["running"] + counts["pending"] + counts["claimed"] > 0  # a stop mid-way

    summary = run(None, resume=run_dir, overrides=["loop.steps=7"], env=CoinEnv())
    check_ledger(summary)  # acked ones were not trained again, unacked ones were not lost
    assert summary["version"] == 7


def test_run_with_mtp_drafting_engines_trains_and_pushes(ray_session, tmp_path):
    from asyncrl.jobs.run import run

    drafting = ("policy.mtp.enabled=true", "rollout.mtp_drafting=true", "rollout.mtp_draft_tokens=2", "learner.mtp_loss_weight=0.5")
    summary = run(config(tmp_path, "name=d", "loop.mode=sync", "loop.steps=2", *drafting), env=CoinEnv())
    check_ledger(summary)
    assert summary["version"] == 2 and summary["engine_versions"] == [2]
    steps = [r for r in read_metrics(tmp_path / "d") if r.get("stepped")]
    assert steps and all(r["mtp_loss"] > 0 for r in steps)  # the drafter trains beside the policy
