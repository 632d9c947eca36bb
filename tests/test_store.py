"""The trajectory store contract, run against both backends: a SQLite file and a real Redis server."""

from __future__ import annotations

import math
import os
import sqlite3
import subprocess
import sys
import threading
import time
import uuid

import pytest

from asyncrl.gateway.store import (
    COUNT_KEYS,
    RolloutClosed,
    SQLiteStore,
    StoreError,
    TrajectoryStore,
    UnknownRollout,
    open_store,
)
from asyncrl.gateway.store.base import turn_from_json
from asyncrl.records import Turn

REDIS_URL = os.environ.get("ASYNCRL_REDIS_URL", "redis://127.0.0.1:6379/0")
# A claim judges a lease expired by its own store's visibility timeout. One that counts every lease as
# expired (as the resume's reclaim store does) expires leases on cue, where waiting out a short timeout
# would make the verdict depend on how fast the machine is; the default (30 s) expires none in a test.
EVERY_LEASE_EXPIRED = 1e-6


def _require_redis():
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as error:
        message = (
            f"REDIS UNREACHABLE at {REDIS_URL} ({error}): the Redis half of the store contract did NOT run. "
            "Start one with `source scripts/services.sh && ensure_redis`."
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return client


@pytest.fixture(params=["sqlite", "redis"])
def make_store(request, tmp_path):
    """Opens store objects on one shared backing store: several objects stand for several processes."""
    opened: list[TrajectoryStore] = []
    if request.param == "sqlite":
        address, namespace = tmp_path / "run.db", "default"
    else:
        client = _require_redis()
        address, namespace = REDIS_URL, f"test-{uuid.uuid4().hex}"

    def make(visibility_timeout_s: float = 30.0) -> TrajectoryStore:
        store = open_store(address, namespace=namespace, visibility_timeout_s=visibility_timeout_s)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()
    if request.param == "redis":
        keys = list(client.scan_iter(match=f"asyncrl:{namespace}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def _turn(rollout_id: str, prompt: list[int], completion: list[int], version: int = 0) -> Turn:
    # Log-probs that print with many digits: a lossy round trip would show.
    logprobs = [-math.pi / (i + 1) for i in range(len(completion))]
    return Turn(rollout_id, prompt, completion, logprobs, [version] * len(completion), engine_id="e0")


def _finished(store: TrajectoryStore, n: int, group_id: str = "g") -> list[str]:
    ids = []
    for i in range(n):
        rollout_id = store.open("task", group_id)
        store.append(_turn(rollout_id, [1, 2, i % 100], [3, 4]))
        store.finish(rollout_id, reward=float(i))
        ids.append(rollout_id)
    return ids


def test_a_rollout_round_trips_exactly(make_store) -> None:
    store = make_store()
    rollout_id = store.open("arithmetic", "group-7", {"seed": 3, "tags": ["a"]})
    first = _turn(rollout_id, [5, 6, 7], [8, 9, 1], version=2)
    second = Turn(rollout_id, [5, 6, 7, 8, 9, 1, 10], [11], [math.nextafter(-1.0, 0.0)], [3], finish_reason="length")
    assert (store.append(first), store.append(second)) == (0, 1)
    assert store.get(rollout_id).status == "running"
    store.finish(rollout_id, reward=0.75, status="ok", metrics={"steps": 2, "passed": True})

    got = store.get(rollout_id)
    assert (got.task, got.group_id, got.metadata) == ("arithmetic", "group-7", {"seed": 3, "tags": ["a"]})
    assert (got.status, got.reward, got.metrics) == ("ok", 0.75, {"steps": 2, "passed": True})
    assert got.created_at <= got.finished_at
    assert [t.index for t in got.turns] == [0, 1]
    assert got.turns[0].logprobs == first.logprobs  # float equality: bit for bit
    assert got.turns[1].logprobs == [math.nextafter(-1.0, 0.0)]
    assert got.turns[1].prompt_token_ids == [5, 6, 7, 8, 9, 1, 10]
    assert (got.turns[1].versions, got.turns[1].finish_reason) == ([3], "length")
    assert got.turns[0].engine_id == "e0" and got.turns[0].created_at > 0


def test_closed_and_unknown_rollouts_are_refused(make_store) -> None:
    store = make_store()
    with pytest.raises(UnknownRollout, match="no rollout 'nope'"):
        store.append(_turn("nope", [1], [2]))
    with pytest.raises(UnknownRollout):
        store.finish("nope", 1.0)
    with pytest.raises(UnknownRollout):
        store.get("nope")

    aborted = store.open("t")
    store.abort(aborted, reason="client went away")
    with pytest.raises(RolloutClosed, match="is aborted; cannot append a turn"):
        store.append(_turn(aborted, [1], [2]))
    with pytest.raises(RolloutClosed, match="is aborted; cannot finish"):
        store.finish(aborted, 1.0)
    assert (store.get(aborted).reward, store.get(aborted).reason) == (None, "client went away")

    done = store.open("t")
    store.finish(done, 0.0, status="env_crash")
    with pytest.raises(RolloutClosed, match="is env_crash; cannot abort"):
        store.abort(done)
    with pytest.raises(RolloutClosed):
        store.append(_turn(done, [1], [2]))

    running = store.open("t", rollout_id="fixed-id")
    assert running == "fixed-id"
    with pytest.raises(StoreError, match="already in use"):
        store.open("t", rollout_id="fixed-id")
    with pytest.raises(StoreError, match="use abort"):
        store.finish(running, 1.0, status="aborted")
    with pytest.raises(StoreError, match="finite"):
        store.finish(running, float("nan"))
    with pytest.raises(StoreError, match="turn 0"):
        store.append(Turn(running, [1], [2], [0.0], [0], index=4))
    assert store.get(running).status == "running"


def test_sampling_options_round_trip_and_turns_stored_without_them_read_back_unset(make_store) -> None:
    store = make_store()
    rollout_id = store.open("t")
    store.append(Turn(rollout_id, [1, 2], [3], [-0.5], [0], temperature=0.0, top_p=1.0, top_k=0))
    store.append(Turn(rollout_id, [1, 2, 3], [4], [-0.25], [0], temperature=0.7, top_p=0.9, top_k=40))
    turns = store.get(rollout_id).turns
    assert [(t.temperature, t.top_p, t.top_k) for t in turns] == [(0.0, 1.0, 0), (0.7, 0.9, 40)]
    # Both backends read a turn through turn_from_json; one stored before turns carried their options:
    old = (
        '{"rollout_id":"r","prompt_token_ids":[1],"completion_token_ids":[2],"logprobs":[-1.0],"versions":[0],'
        '"finish_reason":"stop","branch":0,"engine_id":"e0","timings":{},"created_at":1.0}'
    )
    turn = turn_from_json(old, 3)
    assert (turn.index, turn.completion_token_ids, turn.temperature, turn.top_p, turn.top_k) == (3, [2], None, None, None)


def test_turns_must_be_aligned() -> None:
    with pytest.raises(ValueError, match="2 completion tokens but 1 log-probs"):
        Turn("r", [1], [2, 3], [0.0], [0, 0])


def test_hand_off_survives_a_consumer_crash_without_loss_or_duplicates(make_store) -> None:
    timeout = 0.5
    producer = make_store(timeout)
    ids = _finished(producer, 240)
    aborted = [producer.open("task", "g") for _ in range(60)]
    for rollout_id in aborted:
        producer.abort(rollout_id)
    everything = set(ids) | set(aborted)

    # Consumer "a" claims, never acks, and dies with its connection.
    crashed = make_store(timeout)
    # Before the claim, so that a lease's age is at most the time since: a slow machine only makes the
    # leases older by the time they are checked, never younger (the verdict below holds at any speed).
    lease_taken_by = time.monotonic()
    lost_lease = [t.rollout_id for t in crashed.claim("a", 120)]
    assert len(lost_lease) == 120
    crashed.close()

    # A restarted learner gets everything else at once, and the dead consumer's leases only after the timeout.
    learner = make_store(timeout)
    delivered = []
    while len(delivered) < len(everything):
        batch = learner.claim("b", 50, block_s=0.2)
        assert learner.ack("b", [t.rollout_id for t in batch]) == len(batch)
        if set(t.rollout_id for t in batch) & set(lost_lease):
            # Redis ages a lease in whole milliseconds: one may come back up to 1 ms short of the timeout.
            assert time.monotonic() - lease_taken_by >= timeout - 0.002, "a lease was handed out before its timeout"
        delivered += batch
        assert time.monotonic() - lease_taken_by < 120, "the dead consumer's leases never came back"  # a hang guard only

    delivered_ids = [t.rollout_id for t in delivered]
    assert len(delivered_ids) == len(set(delivered_ids)) == len(everything)
    assert set(delivered_ids) == everything
    assert {t.status for t in delivered if t.rollout_id in set(aborted)} == {"aborted"}
    assert all(t.turns and t.reward is not None for t in delivered if t.rollout_id in set(ids))
    assert learner.claim("b", 50) == []
    # The dead consumer's late ack counts for nothing: its leases went to "b".
    assert make_store(timeout).ack("a", lost_lease) == 0
    counts = learner.counts()
    assert (counts["acked"], counts["pending"], counts["claimed"]) == (300, 0, 0)
    assert (counts["ok"], counts["aborted"], counts["running"]) == (240, 60, 0)


def test_acked_work_is_never_handed_out_again(make_store) -> None:
    store = make_store()
    ids = _finished(store, 5)
    claimed = store.claim("c", 3)
    assert [t.rollout_id for t in claimed] == ids[:3]  # oldest first
    assert store.ack("c", ids[:3]) == 3
    assert store.ack("c", ids[:3]) == 0
    # To this claimer c's leases have expired; acked, they still never come back.
    assert [t.rollout_id for t in make_store(EVERY_LEASE_EXPIRED).claim("d", 10)] == ids[3:]
    counts = store.counts()
    assert (counts["acked"], counts["claimed"], counts["pending"]) == (3, 2, 0)


def test_expired_leases_and_fresh_work_are_handed_out_together_in_done_order(make_store) -> None:
    store = make_store()
    ids = _finished(store, 4)
    assert [t.rollout_id for t in store.claim("x", 2)] == ids[:2]
    later = _finished(store, 2)
    # x's two leases have expired to this claimer; y's own, taken next, have not to `store`.
    assert [t.rollout_id for t in make_store(EVERY_LEASE_EXPIRED).claim("y", 3)] == ids[:3]
    assert [t.rollout_id for t in store.claim("y", 10)] == ids[3:] + later


def test_claim_waits_for_the_next_finished_rollout(make_store) -> None:
    store = make_store()
    assert store.claim("c", 4) == []
    rollout_id = store.open("t")
    finisher = threading.Timer(0.2, store.finish, args=(rollout_id, 1.0))
    finisher.start()
    try:
        got = store.claim("c", 4, block_s=120.0)  # returns at the finish; the wait only bounds a hang
    finally:
        finisher.join()
    assert [t.rollout_id for t in got] == [rollout_id]


def test_list_filters_and_pages_in_opening_order(make_store) -> None:
    store = make_store()
    ids = [store.open("t", group_id=f"g{i % 2}") for i in range(7)]
    store.finish(ids[1], 1.0)
    store.finish(ids[4], 0.0, status="timeout")
    store.abort(ids[5])
    assert [t.rollout_id for t in store.list()] == ids
    assert [t.rollout_id for t in store.list(limit=3, offset=2)] == ids[2:5]
    assert [t.rollout_id for t in store.list(group_id="g1")] == ids[1::2]
    assert [t.rollout_id for t in store.list(status="running", limit=2, offset=1)] == [ids[2], ids[3]]
    assert [t.rollout_id for t in store.list(status="timeout")] == [ids[4]]
    assert store.list(limit=0) == []
    counts = store.counts()
    assert set(counts) == set(COUNT_KEYS)
    assert counts == {**dict.fromkeys(COUNT_KEYS, 0), "running": 4, "ok": 1, "timeout": 1, "aborted": 1, "pending": 3}


def test_concurrent_writers_keep_every_turn_in_order(make_store) -> None:
    store = make_store()
    shared = store.open("t")
    errors: list[BaseException] = []

    def writer(worker: int) -> None:
        try:
            for i in range(10):
                own = store.open("t", metadata={"worker": worker})
                for step in range(4):
                    store.append(_turn(own, [worker, i, step], [step]))
                    store.append(_turn(shared, [worker], [i, step]))
                store.finish(own, reward=float(worker))
        except BaseException as error:  # surfaced below: a thread's exception would vanish otherwise
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors

    turns = store.get(shared).turns
    assert [t.index for t in turns] == list(range(6 * 10 * 4))
    assert sorted((t.prompt_token_ids[0], *t.completion_token_ids) for t in turns) == sorted(
        (w, i, s) for w in range(6) for i in range(10) for s in range(4)
    )
    finished = store.list(status="ok")
    assert len(finished) == 60
    for trajectory in finished:
        worker = trajectory.metadata["worker"]
        assert trajectory.reward == worker
        assert [t.prompt_token_ids[2] for t in trajectory.turns] == [0, 1, 2, 3]
        assert {t.prompt_token_ids[0] for t in trajectory.turns} == {worker}


_WRITER = """
import sys
from asyncrl.records import Turn
from asyncrl.gateway.store import open_store
store = open_store(sys.argv[1])
for i in range(40):
    rollout_id = store.open("t", metadata={"process": sys.argv[2]})
    for step in range(3):
        store.append(Turn(rollout_id, [step], [i], [-0.5], [0]))
    store.finish(rollout_id, 1.0)
"""


def test_sqlite_is_safe_across_processes(tmp_path) -> None:
    path = tmp_path / "run.db"
    SQLiteStore(path).close()
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(p)]) for p in range(3)]
    assert [w.wait(timeout=120) for w in writers] == [0, 0, 0]
    store = SQLiteStore(path)
    done = store.list(status="ok")
    assert len(done) == 120
    assert all([t.index for t in d.turns] == [0, 1, 2] for d in done)
    assert store.counts()["pending"] == 120


def test_closing_sqlite_waits_for_a_call_on_another_thread(tmp_path) -> None:
    # A run's loop can stop waiting for a claim a worker thread is still making, and close the store
    # under it: closing that thread's connection in the middle of its call crashed the process.
    store = SQLiteStore(tmp_path / "run.db")
    for step in range(3):
        rollout_id = store.open("t")
        store.append(Turn(rollout_id, [step], [1], [-0.5], [0]))
        store.finish(rollout_id, 1.0)
    inside, closing = threading.Event(), threading.Event()
    outcome: dict = {}

    def pause() -> int:  # SQLite calls this while the claim's statements run
        inside.set()
        closing.wait(120)  # set by the test once it saw the close wait; the limit only bounds a hang
        return 0  # go on

    def claim_through_the_close() -> None:
        outcome["connection"] = store._db()
        outcome["connection"].set_progress_handler(pause, 1)
        outcome["claimed"] = store.claim("c", 10)

    worker = threading.Thread(target=claim_through_the_close)
    worker.start()
    assert inside.wait(10)
    closer = threading.Thread(target=store.close)
    closer.start()  # while the claim's first statement is inside SQLite
    closer.join(0.2)
    assert closer.is_alive()  # waiting for the claim
    closing.set()
    worker.join(10)
    closer.join(10)
    assert not closer.is_alive() and len(outcome["claimed"]) == 3
    with pytest.raises(sqlite3.ProgrammingError, match="closed database"):
        outcome["connection"].execute("SELECT 1")  # closed by `close`, once the claim had returned
    with pytest.raises(StoreError, match="closed"):
        store.claim("c", 10)
    # The last connection closed: SQLite folded its write-ahead log into the file.
    assert not (tmp_path / "run.db-wal").exists()


def test_closing_sqlite_ends_a_blocking_claim(tmp_path) -> None:
    store = SQLiteStore(tmp_path / "run.db")
    outcome: dict = {}

    def wait_for_work() -> None:
        try:
            store.claim("c", 10, block_s=60)
        except StoreError as error:
            outcome["refused"] = error

    worker = threading.Thread(target=wait_for_work)
    worker.start()
    time.sleep(0.1)  # the claim is waiting for work (the close below ends it either way)
    store.close()
    worker.join(10)
    assert not worker.is_alive() and "closed" in str(outcome["refused"])


def test_open_store_picks_the_backend(tmp_path) -> None:
    in_dir = open_store(tmp_path)
    assert isinstance(in_dir, SQLiteStore) and in_dir.path == tmp_path / "trajectories.db"
    by_url = open_store(f"sqlite:///{tmp_path / 'other.db'}")
    assert by_url.path == tmp_path / "other.db"
    assert isinstance(in_dir, TrajectoryStore)
    in_dir.close()
    by_url.close()
    with pytest.raises(StoreError, match="closed"):
        in_dir.open("t")


def test_sqlite_finish_reads_the_hand_off_order_from_an_index_not_a_scan(tmp_path) -> None:
    # Every finish takes MAX(done_seq); answered by a table scan it made a finish cost grow with
    # every rollout before it (0.4 -> 2.5 ms at 40k, most of the driver's CPU late in a run).
    open_store(tmp_path / "t.db").close()
    db = sqlite3.connect(tmp_path / "t.db")
    plan = " ".join(row[-1] for row in db.execute("EXPLAIN QUERY PLAN SELECT COALESCE(MAX(done_seq), 0) + 1 FROM trajectories"))
    assert "INDEX" in plan and "SCAN" not in plan, plan


def test_gateway_replicas_find_each_other_in_the_store_until_they_withdraw_or_lapse(make_store):
    first, second = make_store(), make_store()  # two gateways' own connections to one store
    first.announce_replica("g0", "http://10.0.0.1:8000", ttl_s=60)
    second.announce_replica("g1", "http://10.0.0.2:8000", ttl_s=60)
    assert first.replicas() == second.replicas() == {"g0": "http://10.0.0.1:8000", "g1": "http://10.0.0.2:8000"}
    second.announce_replica("g1", "http://10.0.0.2:9000", ttl_s=60)  # announced again: the latest URL stands
    assert first.replicas()["g1"] == "http://10.0.0.2:9000"
    second.announce_replica("g2", "http://10.0.0.3:8000", ttl_s=0)  # its time to live is already over
    assert "g2" not in first.replicas()
    first.withdraw_replica("g0")
    assert second.replicas() == {"g1": "http://10.0.0.2:9000"}
