"""Tasks that outlive the request that started them: a stream's turn still being recorded after its
client left (the request's own task is then cancelled, and must not take the recording with it)."""

from __future__ import annotations

import asyncio


class BackgroundTasks:
    def __init__(self) -> None:
        self.running: set[asyncio.Task] = set()

    def start(self, coroutine) -> asyncio.Task:
        """Run `coroutine` on a task of its own, kept here until it ends."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self.running.add(task)
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task) -> None:
        self.running.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: whoever awaited it has it, or nobody is left to tell
