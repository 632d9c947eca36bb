"""The `process` backend: every tool call in a fresh bubblewrap sandbox on this machine.

Namespaces: no network (an empty network namespace), a PID namespace that dies with the call, the
system's /usr mounted read-only and nothing else of the host's files, a private /tmp, and the
episode's scratch directory as /scratch (the only place tool code can write, and what persists
between one episode's calls). When asyncrl runs as root, bubblewrap runs as nobody (65534) so that
RLIMIT_NPROC binds (the kernel never applies it to root, nor to a user namespace's uid that maps to
root outside, so bubblewrap's own --uid would not do). The switch is made by `setpriv` in front of
bubblewrap, not by the subprocess call, where a `preexec_fn` would run Python in the forked child of
a threaded process; the call itself is `spawn.py`'s `Child`, not asyncio's subprocess, for the
same reason (under uvloop that one runs the interpreter's after-fork hooks in the child).
Limits are rlimits set by the supervisor
(`runner.py`); the wall clock is enforced by the supervisor and, as a backstop, here by killing the
sandbox's process group.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import tempfile
from pathlib import Path

from asyncrl.configs.schema import ProcessSandboxConfig
from asyncrl.envs.sandbox.base import OpeningSandbox, SandboxError, ToolResult
from asyncrl.envs.sandbox.calls import HOST_GRACE_S, read_answer, runner_argv, timed_out_on_host
from asyncrl.envs.sandbox.spawn import Child

NOBODY = 65534


def _root_mounts(python: Path) -> list[str]:
    """Read-only /usr, the /bin, /lib... links of a merged-/usr system (or binds where they are real
    directories), and the interpreter's own prefix when it lives outside /usr."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    prefix = python.resolve().parent.parent
    if not prefix.is_relative_to("/usr") and prefix != Path("/"):
        args += ["--ro-bind", str(prefix), str(prefix)]
    return args


class ProcessSandbox:
    def __init__(self, backend: ProcessBackend, scratch: Path) -> None:
        self._backend = backend
        self._scratch = scratch
        self._lock = asyncio.Lock()  # one call at a time, as in a terminal
        self._closed = False

    async def run_python(self, code: str, *, timeout_s: float | None = None) -> ToolResult:
        config = self._backend.config
        timeout_s = config.timeout_s if timeout_s is None else timeout_s
        async with self._lock:
            if self._closed:
                raise SandboxError("sandbox is closed")
            argv = self._backend.bwrap_argv(self._scratch) + runner_argv(
                config.python, code, timeout_s=timeout_s, config=config, limit_processes=True
            )
            try:
                # The host's environment (keys, tokens) stays out. Started synchronously (vfork and
                # exec take a millisecond), so no cancellation can land between start and kill.
                child = Child(argv, env={"PATH": "/usr/bin:/bin"}, cwd="/")
            except OSError as e:
                raise SandboxError(f"could not start bubblewrap: {e}") from e
            try:
                stdout, stderr = await asyncio.wait_for(child.communicate(), timeout_s + HOST_GRACE_S)
            except asyncio.TimeoutError:
                await child.kill()
                return timed_out_on_host(timeout_s)
            except BaseException:
                await asyncio.shield(child.kill())  # cancelled episode: the call must not outlive it
                raise
            return read_answer(stdout, stderr, child.returncode)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        async with self._lock:  # a call still running was killed by its own cancellation
            await asyncio.to_thread(shutil.rmtree, self._scratch, True)
        self._backend.scratch_dirs.discard(self._scratch)

    async def __aenter__(self) -> ProcessSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class ProcessBackend:
    name = "process"

    def __init__(self, config: ProcessSandboxConfig) -> None:
        self.config = config
        self._bwrap = shutil.which("bwrap")
        self.as_root = os.geteuid() == 0
        self._setpriv = shutil.which("setpriv")
        # Scratch directories of sandboxes not closed yet, removed by `close` or at interpreter exit
        # (an episode task that was never finished, a run stopped mid-episode).
        self.scratch_dirs: set[Path] = set()
        atexit.register(self._remove_scratch)

    def bwrap_argv(self, scratch: Path) -> list[str]:
        assert self._bwrap is not None  # `_open` opens no sandbox without it
        net = ["--share-net"] if self.config.network else []
        return [
            *self._drop_privileges(),
            self._bwrap, "--unshare-all", "--unshare-user", *net, "--disable-userns", "--die-with-parent", "--new-session",
            "--clearenv", "--hostname", "sandbox",
            *_root_mounts(Path(self.config.python)),
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(self.config.scratch_mb * 1024 * 1024), "--tmpfs", "/tmp",
            "--bind", str(scratch), "/scratch", "--chdir", "/scratch",
            "--remount-ro", "/",  # the sandbox's own root (a tmpfs holding the mount points)
        ]  # fmt: skip

    def _drop_privileges(self) -> list[str]:
        """The command that runs bubblewrap as nobody, with no supplementary groups, when we are root."""
        if not self.as_root:
            return []
        assert self._setpriv is not None  # `_open` opens no sandbox as root without it
        return [self._setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]

    def open(self) -> OpeningSandbox:
        return OpeningSandbox(self._open)

    async def _open(self) -> ProcessSandbox:
        if self._bwrap is None:
            raise SandboxError("bubblewrap (bwrap) is not installed: apt-get install bubblewrap, or use sandbox.backend=docker")
        if self.as_root and self._setpriv is None:
            raise SandboxError("setpriv (util-linux) is missing: as root, the process sandbox needs it to run tool code as nobody")
        if not os.access(self.config.python, os.X_OK):
            raise SandboxError(f"sandbox interpreter {self.config.python} is missing: install python3 or set sandbox.python")
        scratch = Path(tempfile.mkdtemp(prefix="asyncrl-sandbox-"))
        if self.as_root:
            os.chown(scratch, NOBODY, NOBODY)
        self.scratch_dirs.add(scratch)
        return ProcessSandbox(self, scratch)

    def _remove_scratch(self) -> None:
        while self.scratch_dirs:
            shutil.rmtree(self.scratch_dirs.pop(), ignore_errors=True)

    async def close(self) -> None:
        """Remove the scratch directories of sandboxes left open. No process outlives a call here:
        each one's PID namespace dies with it."""
        await asyncio.to_thread(self._remove_scratch)
        atexit.unregister(self._remove_scratch)
