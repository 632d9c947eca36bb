"""Sandboxes for tool code: one interface (`base.py`), two backends (bubblewrap processes, Docker)."""

from __future__ import annotations

from asyncrl.configs.schema import SandboxConfig
from asyncrl.envs.sandbox.base import OpeningSandbox, Sandbox, SandboxBackend, SandboxError, ToolResult

__all__ = ["OpeningSandbox", "Sandbox", "SandboxBackend", "SandboxConfig", "SandboxError", "ToolResult", "open_backend"]


def open_backend(config: SandboxConfig) -> SandboxBackend:
    """The backend `config.backend` names. Cheap: nothing is started until the first `open()`."""
    if config.backend == "process":
        from asyncrl.envs.sandbox.process_backend import ProcessBackend

        return ProcessBackend(config)
    if config.backend == "docker":
        from asyncrl.envs.sandbox.docker_backend import DockerBackend

        return DockerBackend(config)
    raise ValueError(f"unknown sandbox backend {config.backend!r}")
