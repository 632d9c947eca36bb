"""The gateway's store calls over SQLite: what queued up while the thread was busy commits as one
transaction, each caller hears its own result or refusal (a refusal undoes only its own write), and a
transaction that cannot commit fails every call in it with nothing written."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from asyncrl.gateway.store import StoreError, open_store
from asyncrl.gateway.store_calls import BatchedStoreCalls, PooledStoreCalls, store_calls
from asyncrl.records import Turn

WAIT_S = 60.0


class CountingTransactions:
    """The store, with its transactions counted and a gate the store thread can be held at."""

    def __init__(self, store) -> None:
        self.store, self.transactions = store, 0
        self.held, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.store, name)

    @contextlib.contextmanager
    def transaction(self):
        self.transactions += 1
        with self.store.transaction():
            yield

    def hold(self) -> str:
        """A store call that keeps the store thread until `release` is set."""
        self.held.set()
        assert self.release.wait(WAIT_S)
        return "held"


async def _queued(calls: BatchedStoreCalls, n: int) -> None:
    while len(calls._queue) < n:
        await asyncio.sleep(0.001)


def test_calls_queued_meanwhile_commit_together(tmp_path) -> None:
    store = CountingTransactions(open_store(tmp_path))
    calls = store_calls(store)
    assert isinstance(calls, BatchedStoreCalls)

    async def main():
        holding = asyncio.ensure_future(calls(store.hold))
        while not store.held.is_set():
            await asyncio.sleep(0.001)
        opens = [asyncio.ensure_future(calls(store.open, "task", f"g{i}")) for i in range(50)]
        await _queued(calls, 50)
        store.release.set()
        return await holding, await asyncio.gather(*opens)

    held, ids = asyncio.run(main())
    calls.close()
    assert held == "held" and len(set(ids)) == 50
    assert store.transactions == 2  # the held call's, then the 50 that queued behind it
    assert store.counts()["running"] == 50
    store.close()


def test_a_refusal_undoes_only_its_own_write(tmp_path) -> None:
    store = CountingTransactions(open_store(tmp_path))
    calls = BatchedStoreCalls(store)

    async def main():
        holding = asyncio.ensure_future(calls(store.hold))
        while not store.held.is_set():
            await asyncio.sleep(0.001)
        first = asyncio.ensure_future(calls(store.open, "task", "g", rollout_id="r1"))
        refused = asyncio.ensure_future(calls(store.append, Turn("nobody", [1], [2], [0.0], [0])))
        duplicate = asyncio.ensure_future(calls(store.open, "task", "g", rollout_id="r1"))
        second = asyncio.ensure_future(calls(store.open, "task", "g", rollout_id="r2"))
        await _queued(calls, 4)
        store.release.set()
        await holding
        return await asyncio.gather(first, refused, duplicate, second, return_exceptions=True)

    first, refused, duplicate, second = asyncio.run(main())
    calls.close()
    assert (first, second) == ("r1", "r2")
    assert isinstance(refused, StoreError) and "nobody" in str(refused)
    assert isinstance(duplicate, StoreError) and "already in use" in str(duplicate)
    assert store.transactions == 2
    assert {t.rollout_id for t in store.list()} == {"r1", "r2"}
    store.close()


def test_a_transaction_that_cannot_begin_fails_every_call(tmp_path) -> None:
    store = open_store(tmp_path)
    calls = BatchedStoreCalls(store)
    store.close()

    async def main():
        return await asyncio.gather(*(calls(store.open, "task", "g") for _ in range(3)), return_exceptions=True)

    outcomes = asyncio.run(main())
    calls.close()
    assert all(isinstance(outcome, StoreError) and "closed" in str(outcome) for outcome in outcomes)


def test_stores_without_transactions_get_a_pool(tmp_path) -> None:
    class Plain:
        def get(self, rollout_id):
            return threading.current_thread().name

    calls = store_calls(Plain(), threads=2)
    assert isinstance(calls, PooledStoreCalls)
    assert asyncio.run(calls(Plain().get, "x")).startswith("gateway-store")
    calls.close()


def test_close_runs_what_is_queued_then_refuses(tmp_path) -> None:
    store = open_store(tmp_path)
    calls = BatchedStoreCalls(store)

    async def main():
        opened = await asyncio.gather(*(calls(store.open, "task", "g") for _ in range(5)))
        calls.close()
        with pytest.raises(RuntimeError, match="closed"):
            await calls(store.open, "task", "g")
        return opened

    assert len(asyncio.run(main())) == 5
    assert store.counts()["running"] == 5
    store.close()
