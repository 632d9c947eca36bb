"""One tool call as both backends make it: the supervisor's command line and how its answer reads."""

from __future__ import annotations

import json
import math
from pathlib import Path

from asyncrl.configs.schema import SandboxConfig
from asyncrl.envs.sandbox.base import SandboxError, ToolResult

RUNNER_SOURCE = Path(__file__).with_name("runner.py").read_text()
# Time the host allows beyond the call's own limit before it stops waiting for the supervisor
# (interpreter start, docker exec round trips, a loaded machine).
HOST_GRACE_S = 10.0


def runner_argv(python: str, code: str, *, timeout_s: float, config: SandboxConfig, limit_processes: bool) -> list[str]:
    """`python -c <supervisor> <spec>` for one call. `limit_processes`: set RLIMIT_NPROC, which counts
    per user; right where the user is the sandbox's own (bubblewrap's user namespace), wrong where
    every container shares one uid (docker counts with its pids cgroup instead)."""
    cpu_s = math.ceil(timeout_s) + 1
    rlimits = {
        "RLIMIT_AS": config.memory_mb * 1024 * 1024,
        "RLIMIT_FSIZE": config.scratch_mb * 1024 * 1024,
        "RLIMIT_CPU": cpu_s,
        "RLIMIT_CORE": 0,
    }
    if limit_processes:
        rlimits["RLIMIT_NPROC"] = config.max_processes
    spec = {
        "code": code,
        "timeout_s": timeout_s,
        "max_output_bytes": config.max_output_bytes,
        "rlimits": rlimits,
        "cwd": "/scratch",
        "whole_namespace": True,  # both backends give every call a PID namespace of the sandbox's own
    }
    return [python, "-c", RUNNER_SOURCE, json.dumps(spec)]


def read_answer(stdout: bytes, stderr: bytes, status: int | None) -> ToolResult:
    """The supervisor's JSON line as a ToolResult. A supervisor that died from SIGKILL was taken by
    the memory limit with the tool code (hostile code: a tool error); one that answered nothing else
    means the sandbox is broken."""
    lines = stdout.decode("utf-8", "replace").strip().splitlines()
    if lines:
        try:
            answer = json.loads(lines[-1])
        except json.JSONDecodeError:
            answer = None
        if isinstance(answer, dict):
            return ToolResult(
                stdout=answer["stdout"],
                stderr=answer["stderr"],
                exit_code=answer["exit_code"],
                timed_out=answer["killed"] == "timeout",
                truncated=answer["truncated"],
                killed=answer["killed"],
            )
    if status in (137, -9):
        return ToolResult(stdout="", stderr="", exit_code=None, killed="memory")
    detail = stderr.decode("utf-8", "replace").strip()[-2000:] or "no output"
    raise SandboxError(f"sandbox supervisor failed (exit status {status}): {detail}")


def timed_out_on_host(timeout_s: float) -> ToolResult:
    """The supervisor did not answer within the limit plus grace; the backend killed the sandbox's processes."""
    return ToolResult(
        stdout="", stderr=f"no answer within {timeout_s + HOST_GRACE_S:.0f} s", exit_code=None, timed_out=True, killed="timeout"
    )
