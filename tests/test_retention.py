"""Checkpoint and trajectory retention: the rule, the stores' `delete`, a real run that retires checkpoints
and still resumes, `store.keep_trajectories=false`, and `asyncrl replay prune`."""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import pytest
from loop_helpers import CoinEnv, run_config, run_in_process

from asyncrl.cli import main as cli
from asyncrl.configs.schema import LearnerConfig
from asyncrl.gateway.store import ReadOnlyStore, TrajectoryStore, UnknownRollout, open_reader, open_store
from asyncrl.gateway.store.base import DeleteRefused, TrajectoryPruner
from asyncrl.records import Turn
from asyncrl.sched.rundir import LOOP_STATE_FILE, Retention, RunDir

REDIS_URL = os.environ.get("ASYNCRL_REDIS_URL", "redis://127.0.0.1:6379/0")


# -- the rule --------------------------------------------------------------------------------------


def test_retention_keeps_multiples_and_the_last_k_and_always_the_newest() -> None:
    assert Retention(3, 1).doomed([1, 2, 3, 4, 5]) == [1, 2, 4]
    assert Retention(3, 2).doomed([5, 1, 2, 3, 4]) == [1, 2]
    assert Retention(10, 1).doomed([1, 2]) == [1]  # the newest survives even when no multiple
    assert Retention(None, 2).doomed([2, 4, 6, 8]) == [2, 4]
    assert Retention(None, None).doomed([1, 2, 3]) == []
    assert Retention().doomed([]) == []


def test_retention_from_config_keeps_everything_unless_told() -> None:
    assert Retention.from_config(LearnerConfig()).keeps_all
    rule = Retention.from_config(LearnerConfig(keep_checkpoints_every=4, keep_last_checkpoints=3))
    assert (rule.every, rule.last) == (4, 3)


def test_retire_checkpoints_ignores_one_being_written(tmp_path) -> None:
    rundir = RunDir(tmp_path)
    for version in (1, 2, 3, 4):
        directory = rundir.checkpoint_dir(version)
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"weights")
        (directory / LOOP_STATE_FILE).write_text("{}")
    being_written = rundir.checkpoint_dir(5)
    being_written.mkdir()
    (being_written / "model.safetensors").write_bytes(b"half")

    assert rundir.retire_checkpoints(Retention(2, 1), dry_run=True) == [rundir.checkpoint_dir(1), rundir.checkpoint_dir(3)]
    assert sorted(rundir.complete_checkpoints()) == [1, 2, 3, 4]  # a dry run deletes nothing
    rundir.retire_checkpoints(Retention(2, 1))
    assert sorted(rundir.complete_checkpoints()) == [2, 4]
    assert not rundir.checkpoint_dir(1).exists() and being_written.is_dir()


# -- the stores' delete ----------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "redis"])
def store(request, tmp_path):
    if request.param == "sqlite":
        opened = open_store(tmp_path / "run.db")
        yield opened
        opened.close()
        return
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as error:
        pytest.skip(f"REDIS UNREACHABLE at {REDIS_URL} ({error}): the Redis half did NOT run")
    namespace = f"test-retention-{uuid.uuid4().hex}"
    opened = open_store(REDIS_URL, namespace=namespace, visibility_timeout_s=30.0)
    yield opened
    opened.close()
    keys = list(client.scan_iter(match=f"asyncrl:{namespace}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def _rollout(store: TrajectoryStore, finish: bool = True) -> str:
    rollout_id = store.open("task", "g")
    store.append(Turn(rollout_id, [1, 2], [3, 4], [-0.5, -0.25], [0, 0]))
    if finish:
        store.finish(rollout_id, reward=1.0)
    return rollout_id


def test_delete_takes_acknowledged_rollouts_only(store) -> None:
    assert isinstance(store, TrajectoryPruner)
    acked = [_rollout(store) for _ in range(3)]
    leased = _rollout(store)
    assert [t.rollout_id for t in store.claim("learner", 4)] == [*acked, leased]
    assert store.ack("learner", acked) == 3
    pending, running = _rollout(store), _rollout(store, finish=False)

    for refused in ([running], [acked[0], pending], [leased]):
        with pytest.raises(DeleteRefused, match="not acknowledged"):
            store.delete(refused)
    assert store.acknowledged() == acked  # a refused delete deletes nothing
    before = store.counts()

    assert store.delete(acked[:2]) == 2
    assert store.delete(acked[:2]) == 0  # deleting twice is safe
    for rollout_id in acked[:2]:
        with pytest.raises(UnknownRollout):
            store.get(rollout_id)
    counts = store.counts()
    assert (counts["ok"], counts["acked"]) == (before["ok"] - 2, before["acked"] - 2)
    assert (counts["running"], counts["pending"], counts["claimed"]) == (1, 1, 1)
    assert [t.rollout_id for t in store.list()] == [acked[2], leased, pending, running]
    # The hand-off goes on untouched: the pending one is claimed, then the leased one can be deleted once acked.
    assert [t.rollout_id for t in store.claim("learner", 10)] == [pending]
    assert store.ack("learner", [leased, pending]) == 2
    assert store.delete(store.acknowledged()) == 3
    assert [t.rollout_id for t in store.list()] == [running]


def test_the_read_only_view_cannot_delete(tmp_path) -> None:
    writer = open_store(tmp_path / "run.db")
    _rollout(writer)
    writer.close()
    reader = open_reader(tmp_path / "run.db")
    assert isinstance(reader, ReadOnlyStore) and not isinstance(reader, TrajectoryPruner)
    assert not hasattr(reader, "delete") and not hasattr(reader, "acknowledged")
    reader.close()


# -- real runs -------------------------------------------------------------------------------------


def test_a_run_retires_checkpoints_and_deletes_acknowledged_trajectories_and_still_resumes(tmp_path) -> None:
    overrides = ("name=kept", "learner.checkpoint_every=1", "learner.keep_checkpoints_every=3", "learner.keep_last_checkpoints=1",
                 "store.keep_trajectories=false")  # fmt: skip
    config = run_config(tmp_path, *overrides, "loop.steps=5")
    result = asyncio.run(run_in_process(config, CoinEnv()))
    rundir: RunDir = result["rundir"]
    assert result["state"].version == 5
    assert sorted(rundir.complete_checkpoints()) == [3, 5]
    assert sorted(p.name for p in rundir.checkpoints.iterdir()) == ["step-000003", "step-000005"]
    store = open_store(rundir.store_address(config))
    assert store.acknowledged() == [] and store.counts()["acked"] == 0  # every one was acknowledged, then deleted
    store.close()
    assert rundir.batch_steps() == [1, 2, 3, 4, 5]  # batch records stay: they are a few hundred bytes

    resumed = asyncio.run(run_in_process(run_config(tmp_path, *overrides, "loop.steps=7"), CoinEnv(), resume=True))
    assert resumed["state"].version == 7 and resumed["versions"] == [7]
    assert sorted(rundir.complete_checkpoints()) == [3, 6, 7]
    assert json.loads((rundir.checkpoint_dir(7) / LOOP_STATE_FILE).read_text())["version"] == 7
    counts = resumed["counts"]
    assert counts["acked"] == counts["pending"] == counts["claimed"] == counts["running"] == 0


def test_prune_dry_run_deletes_nothing_and_prune_deletes_exactly_the_acknowledged(tmp_path, capsys) -> None:
    config = run_config(tmp_path, "name=pruned", "learner.checkpoint_every=1", "loop.steps=3")
    result = asyncio.run(run_in_process(config, CoinEnv()))
    rundir: RunDir = result["rundir"]
    store = open_store(rundir.store_address(config))
    acknowledged = store.acknowledged()
    assert acknowledged and len(acknowledged) == store.counts()["acked"]
    # What a live run would still have: a rollout waiting for the learner and one still running.
    waiting, running = _rollout(store), _rollout(store, finish=False)
    checkpoints = sorted(rundir.complete_checkpoints())
    assert checkpoints == [1, 2, 3]

    assert cli(["replay", "prune", str(rundir.path), "--trajectories", "--checkpoints", "--keep-last", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would delete {len(acknowledged)} acknowledged" in out and "would delete 2" in out
    assert store.acknowledged() == acknowledged and sorted(rundir.complete_checkpoints()) == checkpoints

    assert cli(["replay", "prune", str(rundir.path), "--trajectories"]) == 0
    assert f"deleted {len(acknowledged)} acknowledged; kept 2" in capsys.readouterr().out
    assert [t.rollout_id for t in store.list()] == [waiting, running]
    assert sorted(rundir.complete_checkpoints()) == checkpoints  # --checkpoints not asked for

    assert cli(["replay", "prune", str(rundir.path), "--checkpoints", "--keep-every", "2", "--keep-last", "1"]) == 0
    assert sorted(rundir.complete_checkpoints()) == [2, 3]
    assert cli(["replay", "prune", str(rundir.path), "--checkpoints"]) == 1  # the run keeps all: nothing to go by
    assert "keeps every checkpoint" in capsys.readouterr().err
    store.close()
