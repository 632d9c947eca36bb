"""How the gateway's event loop calls its trajectory store, whose calls block: on threads of their own.

Every rollout costs the store several writes (open, a turn per call, finish), and each one over
SQLite was its own transaction: a BEGIN, a COMMIT that writes the WAL, and a thread hop each way.
With hundreds of episodes in flight, calls arrive faster than one thread commits them, so
`BatchedStoreCalls` runs whatever has queued up meanwhile in one transaction (each call in a
savepoint of its own, so one call's refusal undoes only that call) and answers them after the
commit: a caller still hears back only once its write is durable, as before. Stores that take
writes in parallel (Redis) get a small thread pool instead (`PooledStoreCalls`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MAX_BATCH = 256
"""Most calls in one transaction: bounds how long the write lock is held and how late the first caller hears back."""


def store_calls(store: Any, *, threads: int = 4) -> BatchedStoreCalls | PooledStoreCalls:
    """Batched on one thread for a store with `transaction()` (SQLite), else a pool of `threads`."""
    return BatchedStoreCalls(store) if hasattr(store, "transaction") else PooledStoreCalls(threads)


class PooledStoreCalls:
    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gateway-store")

    async def __call__(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class BatchedStoreCalls:
    def __init__(self, store: Any) -> None:
        self.store = store
        self._queue: deque[tuple[Callable, asyncio.Future, asyncio.AbstractEventLoop]] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="gateway-store", daemon=True)
        self._thread.start()

    async def __call__(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cv:
            if self._closing:
                raise RuntimeError("the gateway's store calls are closed")
            self._queue.append((functools.partial(fn, *args, **kwargs), future, loop))
            self._cv.notify()
        return await future

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), MAX_BATCH))]
            outcomes = self._run(batch)
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            for (_, future, loop), outcome in zip(batch, outcomes, strict=True):
                by_loop.setdefault(loop, []).append((future, *outcome))
            for loop, answers in by_loop.items():
                with contextlib.suppress(RuntimeError):  # that loop is closed: no one waits for these answers any more
                    loop.call_soon_threadsafe(_answer, answers)

    def _run(self, batch: list) -> list[tuple[bool, Any]]:
        """(succeeded, result or exception) per call, all in one transaction; a failed commit fails them all."""
        outcomes: list[tuple[bool, Any]] = []
        try:
            with self.store.transaction():
                for call, _, _ in batch:
                    try:
                        outcomes.append((True, call()))
                    except Exception as error:  # this call's own refusal: its savepoint is undone, the rest go on
                        outcomes.append((False, error))
        except Exception as error:  # the transaction itself (the disk, the connection): nothing was written
            return [(False, error)] * len(batch)
        return outcomes


def _answer(answers: list[tuple[asyncio.Future, bool, Any]]) -> None:
    for future, succeeded, value in answers:
        if future.done():  # its caller was cancelled meanwhile
            continue
        if succeeded:
            future.set_result(value)
        else:
            future.set_exception(value)
