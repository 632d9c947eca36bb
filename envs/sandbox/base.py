"""What every sandbox backend promises: run Python, report what happened, never let tool code out.

Hostile or broken tool code is the model's problem, so it comes back as a `ToolResult` (the model
reads the error and carries on); only a failure of the sandbox itself raises `SandboxError`, which
ends the episode as `env_crash`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

KillReason = Literal["timeout", "memory", "pids", "output"]

_KILL_TEXT = {
    "timeout": "killed: the time limit was reached",
    "memory": "killed: the memory limit was reached",
    "pids": "the process limit was reached",
    "output": "killed: the output limit was reached",
}


@dataclass
class ToolResult:
    stdout: str
    stderr: str
    exit_code: int | None
    """The tool process's exit status; None when it died from a signal (the sandbox's or the kernel's)."""
    timed_out: bool = False
    truncated: bool = False
    """Output over the limit was cut."""
    killed: KillReason | None = None
    """Why the sandbox stopped the code, when a limit did."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed is None

    def as_tool_message(self) -> str:
        """What the model sees: the output, then one `[tool error: ...]` line when the call failed."""
        parts = [self.stdout]
        if self.stderr:
            parts.append(self.stderr)
        if self.truncated:
            parts.append("[output truncated]")
        if self.killed is not None:
            parts.append(f"[tool error: {_KILL_TEXT[self.killed]}]")
        elif self.exit_code != 0:
            status = "killed by a signal" if self.exit_code is None else f"exit code {self.exit_code}"
            parts.append(f"[tool error: {status}]")
        return "\n".join(p.rstrip("\n") for p in parts if p)


class SandboxError(Exception):
    """The sandbox itself failed (engine gone, container could not start) -> episode status env_crash."""


class Sandbox(Protocol):
    """One episode's sandbox. Calls run one at a time; files in /scratch last until `close`."""

    async def run_python(self, code: str, *, timeout_s: float | None = None) -> ToolResult: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(self, *exc: object) -> None: ...


class SandboxBackend(Protocol):
    name: str

    def open(self) -> OpeningSandbox:
        """A fresh sandbox for one episode: `async with backend.open() as sandbox` (closed on the way
        out), or `sandbox = await backend.open()` when the caller closes it itself."""
        ...

    async def close(self) -> None:
        """Release what the backend holds (sandboxes left open, its engine connection)."""
        ...


class OpeningSandbox:
    """What the backends' `open()` returns: `await` it for the sandbox, or enter it with `async with`
    (the sandbox is then closed on the way out, also when the episode is cancelled)."""

    def __init__(self, start: Callable[[], Awaitable[Sandbox]]) -> None:
        self._start = start
        self._sandbox: Sandbox | None = None

    def __await__(self) -> Generator[Any, Any, Sandbox]:
        return self._start().__await__()

    async def __aenter__(self) -> Sandbox:
        self._sandbox = await self._start()
        return self._sandbox

    async def __aexit__(self, *exc: object) -> None:
        if self._sandbox is not None:
            await self._sandbox.close()
