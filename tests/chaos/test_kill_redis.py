"""Kill -9 the Redis server that is a real `asyncrl run`'s trajectory store, mid-run, and restart it
on the same port from its append-only file; and what the AOF keeps and what the store's retries do.

The run (tests/chaos/conftest.py: `asyncrl run` in its own session, `store.type=redis`) has a private
redis-server (services_helpers.RedisServer) with `--appendonly yes --appendfsync always`. It is killed
after a checkpoint and a learner step past it, stays down until the run's store calls have met the
outage, comes back from its files, and the run must finish with its books balanced from the store
and the checkpoints.

Why `always`: Redis then writes and fsyncs each command to the AOF before it replies, so a kill at any
moment loses nothing the run was told is done, however slow the disk. With `everysec` Redis writes its
AOF buffer to the file (the kernel's page cache) before it sends the replies of the commands in it
and fsyncs once a second, so a kill -9 of redis-server alone loses nothing already written to the
file (the first test shows it) and a host crash up to the last second. The one gap: while a
background fsync is still running (a busy disk) Redis defers the write up to 2 s but still replies,
so a kill in that spell can lose writes it acknowledged (`aof_buffer_length` > 0 in INFO); the run
test's verdict would then depend on the disk's speed.
"""

from __future__ import annotations

import shutil
import time
import uuid

import pytest
from services_helpers import RedisServer, ReplyDroppingProxy, hold_port_down, record_figures, wait_for

from asyncrl.gateway.store import StoreError, open_reader
from asyncrl.gateway.store.redis import RedisStore, RedisUnavailable
from asyncrl.records import TERMINAL_STATUSES, Turn

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def test_writes_in_the_aof_file_survive_a_kill_9_of_redis(redis_server):
    client = redis_server.client()
    for i in range(500):
        client.set(f"k{i}", i)
    # Written to the file once INFO says the AOF buffer is empty (it always is, unless a slow fsync deferred it).
    deferred = client.info("persistence")["aof_buffer_length"] > 0
    wait_for(lambda: client.info("persistence")["aof_buffer_length"] == 0, "the AOF buffer to reach the file")
    client.close()
    redis_server.kill()
    redis_server.start()
    client = redis_server.client()
    assert [client.get(f"k{i}") for i in range(500)] == [str(i) for i in range(500)]
    client.close()
    record_figures("redis_aof_kill9", {"acknowledged_writes": 500, "lost": 0, "write_was_deferred": deferred})


def test_a_store_write_whose_reply_is_lost_is_applied_once(redis_server):
    """A write Redis applied whose reply never came back (the connection cut between the two, as a kill
    can) is retried, and the retry recognises it: one open, one turn, one finish, one lease."""
    proxy = ReplyDroppingProxy(redis_server.port)
    store = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", namespace=uuid.uuid4().hex, reconnect_s=10.0)
    store.finish(store.open(task="warm-up"), 0.0)  # every script loaded, so the reply dropped is the write's own

    def lose_the_reply(call):
        proxy.dropped.clear()
        proxy.armed.set()
        result = call()
        assert proxy.dropped.is_set()
        return result

    rollout_id = lose_the_reply(lambda: store.open(task="t", group_id="g"))
    turn = Turn(rollout_id, [1, 2], [3], [-0.5], [0], "stop", created_at=time.time())
    assert lose_the_reply(lambda: store.append(turn)) == 0
    lose_the_reply(lambda: store.finish(rollout_id, 1.0))
    leased = lose_the_reply(lambda: store.claim("learner", 10))
    assert sorted(t.task for t in leased) == ["t", "warm-up"]
    assert store.claim("learner", 10) == []  # nothing leased twice
    assert lose_the_reply(lambda: store.ack("learner", [t.rollout_id for t in leased])) in (0, 2)
    got = store.get(rollout_id)
    assert (got.status, got.reward, len(got.turns)) == ("ok", 1.0, 1)
    counts = store.counts()
    assert (counts["running"], counts["ok"], counts["acked"], counts["claimed"], counts["pending"]) == (0, 2, 2, 0, 0)
    store.close()
    proxy.close()


def test_a_redis_that_stays_down_or_comes_back_empty_is_a_clear_error(redis_server):
    store = RedisStore(redis_server.url, namespace="gone", reconnect_s=0.5)
    store.finish(store.open(task="t"), 1.0)
    redis_server.kill()
    with pytest.raises(RedisUnavailable, match=rf"Redis at {redis_server.url} did not answer for 0.5 s"):
        store.counts()
    shutil.rmtree(redis_server.directory / "appendonlydir")  # back, but without the run's data
    redis_server.start()
    with pytest.raises(StoreError, match="no longer holds this run's data"):
        store.claim("learner", 10)
    store.close()


STEPS = 8
OUTAGE_CALLS = 8
"""Connections the run's store clients make to the dead Redis's port before it comes back (an outage they surely met)."""


@pytest.fixture
def durable_redis(tmp_path):
    """The run's store: a private redis-server whose every acknowledged write is fsynced (module docstring)."""
    server = RedisServer(tmp_path / "redis-aof", appendfsync="always").start()
    yield server
    server.stop()


def terminal(store) -> int:
    counts = store.counts()
    return sum(counts[status] for status in TERMINAL_STATUSES)


def test_a_run_whose_redis_is_killed_and_restarted_from_its_aof_finishes_with_every_rollout_once(durable_redis, start_run, books, figures):
    name = "redis"  # the run's name is its store namespace
    run = start_run(name, f"loop.steps={STEPS}", "store.type=redis", f"store.url={durable_redis.url}")
    run.wait_until(lambda: run.step() > run.committed() >= 2, "a learner step past a checkpoint")
    store = open_reader(durable_redis.url, namespace=name)
    terminal_at_kill, step_at_kill = terminal(store), run.step()
    killed_at = time.time()
    durable_redis.kill()
    hold_port_down(durable_redis.port, OUTAGE_CALLS)
    down_for = time.time() - killed_at
    durable_redis.start()
    restarted_at = time.time()
    recorded_at_restart = terminal(store)  # the test's first call on the restarted server
    run.wait_until(lambda: terminal(store) > recorded_at_restart, "the store to record a rollout after the restart")
    recorded_at = time.time()
    run.wait_until(lambda: run.step() > step_at_kill, "a learner step after the restart")
    stepped_at = time.time()
    store.close()

    assert run.finish() == 0, run.tail()
    summary = run.summary()
    assert summary["version"] == STEPS and summary["engine_versions"] == [STEPS]
    assert "DB loaded from append only file" in (durable_redis.directory / "redis.log").read_text()
    accounts = books(run.run_dir)  # from the restarted Redis: what was there before the kill is all still there
    assert accounts["started"] > terminal_at_kill

    figures("kill_redis", {
        "redis_down_s": round(down_for, 3), "calls_that_met_the_outage": OUTAGE_CALLS,
        "restart_to_store_progress_s": round(recorded_at - restarted_at, 3),
        "kill_to_store_progress_s": round(recorded_at - killed_at, 3),
        "kill_to_next_step_s": round(stepped_at - killed_at, 2),
        "appendfsync": durable_redis.appendfsync, "terminal_at_kill": terminal_at_kill, "step_at_kill": step_at_kill,
        "steps": STEPS, **accounts,
    })  # fmt: skip
