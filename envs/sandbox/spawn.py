"""Start a process from the event loop without running any Python in the forked child.

asyncio's own subprocesses are the wrong tool in a run's driver: under uvloop (`asyncrl run` uses
it) `create_subprocess_exec` forks through libuv and runs the interpreter's after-fork hooks in the
child (uvloop issue #749). In a process with many threads (torch, Ray's gRPC, wandb, the store)
such a hook can block forever on a lock another thread held at the fork, and libuv's spawn then
blocks the whole event loop waiting for that child to exec: a run stalled that way, every episode
with it. `subprocess.Popen` (vfork and exec in C, no hooks, no `preexec_fn`) does not have the
problem; here its pipes and its exit are awaited on whichever event loop is running (the pipes
through `connect_read_pipe`, the exit through a pidfd), so no thread waits on a child either.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from typing import IO


class Child:
    """A started process with its stdout and stderr piped; `communicate` and `kill` are awaitable."""

    def __init__(self, argv: list[str], *, env: dict[str, str], cwd: str) -> None:
        # A new session: the process group is bubblewrap and everything it starts, killed as one.
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True
        )

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def communicate(self) -> tuple[bytes, bytes]:
        """Everything the process wrote, once it has exited and closed its pipes."""
        stdout, stderr, _ = await asyncio.gather(_read_all(self.proc.stdout), _read_all(self.proc.stderr), self.wait())
        return stdout, stderr

    async def wait(self) -> int:
        if self.proc.returncode is None:
            await _exited(self.proc.pid)
            self.proc.wait()  # reaps at once: the process has exited
        return self.proc.returncode

    async def kill(self) -> None:
        """SIGKILL the process group and everything it started, and return once all of it is gone.

        Bubblewrap's PID namespace dies with its init, but asynchronously: its init gets SIGKILL
        from the parent-death signal after the outer process is reaped, and the kernel then kills
        the namespace. So the processes seen below this one are killed and awaited too; the
        namespace's init is among them, and its exit comes only after the namespace is empty.
        """
        below = _pidfds(_descendants(self.proc.pid))
        try:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            for fd in below:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            await self.wait()
            for fd in below:
                await _readable(fd)
        finally:
            for fd in below:
                os.close(fd)


async def _read_all(pipe: IO[bytes] | None) -> bytes:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**30)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        return await reader.read()
    finally:
        transport.close()


async def _exited(pid: int) -> None:
    """Returns once process `pid` (our child) has exited, without reaping it."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await _readable(pidfd)
    finally:
        os.close(pidfd)


async def _readable(pidfd: int) -> None:
    """Returns once the process behind `pidfd` has exited (a pidfd polls readable then)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await done
    finally:
        loop.remove_reader(pidfd)


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` now, found through /proc's children lists."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _pidfds(pids: list[int]) -> list[int]:
    fds = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds.append(os.pidfd_open(pid))
    return fds
