"""Tasks that outlive the request that started them: a stream's turn still being recorded after its
client left (the request's own task is then cancelled, and must not take the recording with it). The
gateway's shutdown waits for them (`drain`), so stopping it loses no turn being recorded."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


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

    async def drain(self, timeout_s: float) -> None:
        """Wait for every running task, at most `timeout_s` seconds; then cancel, with a warning, what is left."""
        if not self.running:
            return
        _, late = await asyncio.wait(set(self.running), timeout=timeout_s)
        for task in late:
            task.cancel()
        if late:
            log.warning("gateway shutdown: %d background recording(s) still running after %.0f s were cancelled", len(late), timeout_s)
