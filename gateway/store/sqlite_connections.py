"""The SQLite store's connections: one per thread (and per forked process), and their end.

A sqlite3 connection must not be shared across threads or processes, so each thread opens its own.
Closing them is the delicate part: a run can stop waiting for a call that a worker thread is still
making (a claim left running by `asyncio.to_thread`), and closing that thread's connection under the
call crashes the process. So every call of the store is counted (`call`), and `close` refuses new
calls, waits for the ones in progress, then closes every connection (the last to close folds the
write-ahead log into the file).
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .base import StoreError


class ThreadConnections:
    def __init__(self, connect: Callable[[], sqlite3.Connection], name: str) -> None:
        """`connect`: opens one connection; `name`: the store, for errors."""
        self._connect, self._name = connect, name
        self.local = threading.local()
        """This thread's connection and the store's per-thread state (`SQLiteStore` keeps its batching flag here)."""
        self._opened: list[sqlite3.Connection] = []
        self._calls = threading.Condition()
        self._running = 0
        """Calls in progress, on any thread."""
        self._closed = False

    @contextmanager
    def call(self) -> Iterator[None]:
        """One call of the store's, counted until it returns; refused once closed (unless this thread is
        already inside a call that `close` waits for)."""
        local = self.local
        with self._calls:
            if self._closed and not getattr(local, "calls", 0):
                raise StoreError(f"{self._name} is closed")
            self._running += 1
        local.calls = getattr(local, "calls", 0) + 1
        try:
            yield
        finally:
            local.calls -= 1
            with self._calls:
                self._running -= 1
                self._calls.notify_all()

    def get(self) -> sqlite3.Connection:
        """This thread's connection, opened on first use."""
        local = self.local
        if self._closed and not getattr(local, "calls", 0):
            raise StoreError(f"{self._name} is closed")
        if getattr(local, "pid", None) != os.getpid():
            local.db, local.pid = self._connect(), os.getpid()
            with self._calls:
                self._opened.append(local.db)
        return local.db

    def wait_closed(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for `close`; whether it came (a blocking claim's pause between polls)."""
        with self._calls:
            return self._calls.wait_for(lambda: self._closed, timeout=timeout)

    def close(self) -> None:
        """Refuse new calls, wait for those in progress on other threads, then close every connection."""
        own = getattr(self.local, "calls", 0)
        with self._calls:
            self._closed = True
            self._calls.notify_all()  # a blocking claim's `wait_closed`
            self._calls.wait_for(lambda: self._running == own)
            opened, self._opened = self._opened, []
        for db in opened:
            db.close()
