"""Opening a recorded run for replay (`asyncrl/replay/run.py`): read-only, and errors that list what exists."""

from __future__ import annotations

import asyncio
import hashlib
import random
import sqlite3

import pytest
from loop_helpers import CoinEnv, run_in_process
from loop_helpers import run_config as config

from asyncrl.gateway.store import SQLITE_FILENAME, ReadOnlyStore, open_reader
from asyncrl.replay.run import ReplayError, RunView, Selection


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A real 3-step run (in-process loop, tiny policy), checkpoints every 2 versions."""
    run = config(tmp_path_factory.mktemp("runs"), "name=r", "loop.steps=3", "learner.checkpoint_every=2")
    result = asyncio.run(run_in_process(run, CoinEnv()))
    return result["rundir"].path


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_run_opens_read_only_and_replay_cannot_write_into_it(recorded):
    store_file = recorded / SQLITE_FILENAME
    before = _digest(store_file)
    with RunView.open(recorded) as view:
        assert isinstance(view.store, ReadOnlyStore)
        assert not hasattr(view.store, "append") and not hasattr(view.store, "ack")
        some = view.store.list(limit=3)
        assert len(some) == 3 and all(t.turns for t in some)
        # Even the store underneath refuses writes: the file was opened with mode=ro.
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            view.store._store.open(task="x")  # reaching past the read-only view, on purpose
    assert _digest(store_file) == before


def test_reading_a_missing_store_creates_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_reader(tmp_path / "nothing.db")
    assert not (tmp_path / "nothing.db").exists()
    with pytest.raises(ReplayError, match="no such run directory"):
        RunView.open(tmp_path / "missing")
    with pytest.raises(ReplayError, match="not a run directory"):
        RunView.open(tmp_path)


def test_checkpoints_are_the_start_and_each_kept_step(recorded):
    with RunView.open(recorded) as view:
        assert [(c.version, c.label) for c in view.checkpoints()] == [(0, "start"), (2, "v2"), (3, "v3")]
        assert view.start().path is None  # the tiny policy of the seed: no SFT in these runs
        assert view.nearest_checkpoint(1).version == 0 and view.nearest_checkpoint(3).version == 3
        assert view.checkpoint_at_or_before(1).version == 0 and view.final_checkpoint().version == 3
        with pytest.raises(ReplayError, match=r"no checkpoint of version 1 .* there are 0, 2, 3"):
            view.checkpoint(1)


def test_unknown_rollouts_and_steps_list_what_exists(recorded):
    with RunView.open(recorded) as view:
        with pytest.raises(ReplayError, match=r"some that exist: [0-9a-f]{32}"):
            view.trajectory("nope")
        steps = view.rundir.batch_steps()
        if steps:  # the loop records batches (loop.record_batches, on by default)
            with pytest.raises(ReplayError, match=f"recorded steps are {steps[0]}"):
                view.batch(999)


def test_selection_narrows_by_every_field(recorded):
    with RunView.open(recorded) as view:
        everything = view.select(Selection())
        assert everything and all(t.task == "coin" for t in everything)
        rewarded = view.select(Selection(reward_min=0.5))
        assert rewarded and all(t.reward is not None and t.reward >= 0.5 for t in rewarded)
        assert len(rewarded) + len(view.select(Selection(reward_max=0.49))) == len([t for t in everything if t.reward is not None])
        assert view.select(Selection(task="other")) == []
        assert len(view.select(Selection(limit=2))) == 2
        one = everything[0]
        assert view.select(Selection(rollout_id=one.rollout_id)) == [one]


def test_every_rollout_records_the_seed_that_draws_its_problem_again(recorded):
    """`asyncrl replay episode` draws a rollout's problem again from its recorded task seed."""
    env = CoinEnv()
    with RunView.open(recorded) as view:
        trajectories = view.select(Selection())
        by_group: dict[str, set[int]] = {}
        for t in trajectories:
            by_group.setdefault(t.group_id, set()).add(t.metadata["task_seed"])
        assert all(len(seeds) == 1 for seeds in by_group.values())  # one problem per GRPO group
        for t in trajectories:
            problem = env.sample_task(random.Random(t.metadata["task_seed"]), "train")
            # CoinEnv's prompt is the problem itself: the recorded first prompt must contain it.
            assert str(problem) in _first_prompt_text(t)


def _first_prompt_text(trajectory) -> str:
    from asyncrl.policy.tokenizer import build_tokenizer

    return build_tokenizer().decode(trajectory.turns[0].prompt_token_ids)


def test_a_redis_run_is_read_through_the_reading_verbs_and_an_unknown_namespace_creates_nothing():
    import os
    import uuid

    import redis

    from asyncrl.gateway.store import open_store
    from asyncrl.records import Turn

    url = os.environ.get("ASYNCRL_REDIS_URL", "redis://127.0.0.1:6379/0")
    namespace = f"replay-{uuid.uuid4().hex[:8]}"
    writer = open_store(url, namespace=namespace)
    client = redis.Redis.from_url(url)
    try:
        rollout = writer.open(task="t", group_id="g")
        writer.append(Turn(rollout_id=rollout, prompt_token_ids=[1, 2], completion_token_ids=[3], logprobs=[-0.5], versions=[0]))
        writer.finish(rollout, 1.0)
        reader = open_reader(url, namespace=namespace)
        assert [t.rollout_id for t in reader.list()] == [rollout] and reader.get(rollout).turns[0].logprobs == [-0.5]
        assert not hasattr(reader, "finish") and not hasattr(reader, "claim")
        reader.close()
        missing = f"replay-missing-{uuid.uuid4().hex[:8]}"
        with pytest.raises(FileNotFoundError, match="nothing recorded"):
            open_reader(url, namespace=missing)
        assert client.keys(f"asyncrl:{missing}:*") == []
    finally:
        writer.close()
        keys = client.keys(f"asyncrl:{namespace}:*")
        if keys:
            client.delete(*keys)
        client.close()
