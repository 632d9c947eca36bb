"""Kill -9 the Redis server under a run whose trajectory store it is, and restart it from its AOF.

The run is the real loop (sched/loop.py: admission, claims, learner steps, pushes, checkpoints, the
books) over in-process engine and learner, the real gateway over loopback and the Redis store, as
tests/test_loop_inprocess.py runs it; only Redis is a separate process, started with
`--appendonly yes --appendfsync everysec` and killed when the store shows enough finished rollouts.

What Redis loses: with `appendfsync everysec` Redis writes its AOF buffer to the file (the kernel's
page cache) before it sends the replies of the commands in it, and fsyncs once a second. A kill -9 of
redis-server alone therefore loses nothing already written to the file (the kernel still has it), and
the first test shows it; a host crash loses up to the last second that was not fsynced. The one gap:
while a background fsync is still running (a busy disk) Redis defers the write up to 2 s but still
replies, so a kill in that spell can lose writes it acknowledged (`aof_buffer_length` > 0 in INFO).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
import uuid

import pytest
from loop_helpers import CoinEnv, run_config, run_in_process, started
from services_helpers import PATIENCE_S, RedisServer, ReplyDroppingProxy, hold_port_down, record_figures, wait_for

from asyncrl.gateway.store import StoreError, open_store
from asyncrl.gateway.store.redis import RedisStore, RedisUnavailable
from asyncrl.records import TERMINAL_STATUSES, Turn
from asyncrl.sched.rundir import LOOP_STATE_FILE

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


class KillRedisWhen:
    """Watches the run's store from another thread; when `at` rollouts are terminal, kills Redis -9,
    keeps it down until the run's calls have met the outage `attempts` times, restarts it from its
    files and measures how long until the store records progress again."""

    def __init__(self, server: RedisServer, namespace: str, at: int, attempts: int = 8) -> None:
        self.server, self.at, self.attempts, self.figures = server, at, attempts, {}
        self.store = open_store(server.url, namespace=namespace)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def terminal(self) -> int:
        counts = self.store.counts()
        return sum(counts[status] for status in TERMINAL_STATUSES)

    def _watch(self) -> None:
        try:
            wait_for(lambda: self.terminal() >= self.at, f"{self.at} finished rollouts in the store")
            before = self.terminal()
            killed = time.monotonic()
            self.server.kill()
            hold_port_down(self.server.port, self.attempts)
            self.server.start()
            restarted = time.monotonic()
            wait_for(lambda: self.terminal() > before, "the store to record a rollout after the restart")
            progress = time.monotonic()
            self.figures = {
                "terminal_at_kill": before, "calls_that_met_the_outage": self.attempts, "redis_down_s": round(restarted - killed, 3),
                "recovery_after_restart_s": round(progress - restarted, 3), "kill_to_progress_s": round(progress - killed, 3),
            }  # fmt: skip
        except BaseException as error:
            self.error = error

    def result(self) -> dict:
        self.thread.join(PATIENCE_S)
        self.store.close()
        if self.error is not None:
            raise self.error
        assert self.figures, "Redis was never killed: the run ended before the store showed enough rollouts"
        return self.figures


def test_a_run_survives_a_kill_9_of_its_redis_and_accounts_for_every_rollout_once(redis_server, tmp_path, monkeypatch):
    name = "redis-chaos"
    config = run_config(
        tmp_path, f"name={name}", "loop.steps=8", "learner.checkpoint_every=2", "store.type=redis", f"store.url={redis_server.url}"
    )
    handed: list[str] = []  # every trajectory the store hands the loop, over the whole run
    claim = RedisStore.claim

    def observed_claim(self, consumer, max_n, block_s=0.0):
        claimed = claim(self, consumer, max_n, block_s)
        handed.extend(t.rollout_id for t in claimed)
        return claimed

    monkeypatch.setattr(RedisStore, "claim", observed_claim)
    watcher = KillRedisWhen(redis_server, name, at=20)
    began = time.monotonic()
    result = asyncio.run(run_in_process(config, CoinEnv()))
    figures = watcher.result()
    state, counts = result["state"], result["counts"]

    everyone = {t.rollout_id for t in open_store(redis_server.url, namespace=name).list()}
    assert started(counts) == len(everyone) > figures["terminal_at_kill"]
    # Every rollout started ended in exactly one account, each was handed to the learner once, and every one is acknowledged.
    assert sum(state.ledger.values()) == started(counts)
    assert sorted(handed) == sorted(everyone)
    assert counts["acked"] == started(counts) and counts["running"] == counts["pending"] == counts["claimed"] == 0
    assert state.version == 8 and result["versions"] == [8]
    # The checkpoints: the last holds the same books, and no rollout was acknowledged by two of them.
    states = [json.loads(path.read_text()) for path in sorted(result["rundir"].checkpoints.glob(f"step-*/{LOOP_STATE_FILE}"))]
    assert states[-1]["ledger"] == state.ledger
    acked_by_checkpoints = [rollout_id for saved in states for rollout_id in saved["acking"]]
    assert len(acked_by_checkpoints) == len(set(acked_by_checkpoints)) and set(acked_by_checkpoints) <= everyone
    record_figures(
        "kill_redis", {**figures, "rollouts": started(counts), "lost": 0, "trained_twice": 0, "run_s": round(time.monotonic() - began, 1)}
    )
