"""CPU work of a request (rendering, tokenizing a big prompt) on daemon threads, off the event loop.

Not a `ThreadPoolExecutor` (nor `asyncio.to_thread`): the interpreter joins those workers at exit and
`asyncio.run` waits for its default one, so a gateway stopped by SIGTERM waited for every big prompt
being tokenized (over a minute for two 7 MB prompts on a busy machine) before it exited. Nothing waits
for these threads: a job still running at exit is dropped with the process, and its request, already
cancelled by the server's shutdown, gets no answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class CpuWorkers:
    """Up to `threads` daemon threads, started as jobs need them (most gateways never get a big prompt)."""

    def __init__(self, threads: int | None = None, name: str = "gateway-cpu") -> None:
        self._most, self._name = threads or min(8, os.cpu_count() or 2), name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._waiting = 0
        """Jobs queued or running."""
        self._lock = threading.Lock()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a worker thread; its exception, if it raises, is raised here."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._waiting += 1
            if self._waiting > len(self._threads) < self._most:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        self._jobs.put((loop, future, fn, args))
        return await future

    def close(self) -> None:
        """Let the workers end once the jobs queued before this are done (does not wait for them)."""
        with self._lock:
            for _ in self._threads:
                self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, fn, args = job
            outcome: tuple[Any, BaseException | None]
            try:
                outcome = (fn(*args), None)
            except BaseException as error:  # handed to the awaiting request, raised there
                outcome = (None, error)
            with self._lock:
                self._waiting -= 1
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for this any more
                loop.call_soon_threadsafe(_settle, future, *outcome)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the request was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
