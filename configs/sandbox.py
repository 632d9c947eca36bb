"""The sandbox section: where tool code runs, a process or a Docker container (a choice by `sandbox.backend`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Tag, TypeAdapter

from .section import Section, choice


class SandboxBase(Section):
    """Where tool code runs (`asyncrl.envs.sandbox`): the limits every call runs under, whatever the backend."""

    timeout_s: float = Field(10.0, gt=0, le=3600)
    """Wall-clock limit of one tool call; the call's whole process tree is killed when it passes."""
    max_output_bytes: int = Field(8192, ge=256, le=16 * 1024 * 1024)
    """stdout plus stderr kept from one call; a call that writes more is cut there and killed."""
    memory_mb: int = Field(256, ge=32, le=65536)
    """Address space of the tool process (process and docker) and memory of the container (docker)."""
    max_processes: int = Field(32, ge=1, le=4096)
    """Processes and threads tool code may run at once (a fork bomb stops here)."""
    scratch_mb: int = Field(64, ge=1, le=65536)
    """Size of the writable /scratch directory (docker: tmpfs size; process: largest file)."""
    network: bool = False
    """Give tool code a network (docker: the engine's default network; process: the host's)."""

    def on_backend(self, backend: str) -> SandboxConfig:
        """These limits on `backend` (what the sandbox bench measures each backend with); that backend's
        own fields are this section's when it is the same backend, else their defaults."""
        if isinstance(self, (ProcessSandboxConfig, DockerSandboxConfig)) and self.backend == backend:
            return self
        return _SANDBOX.validate_python({**self.model_dump(include=set(SandboxBase.model_fields)), "backend": backend})


class ProcessSandboxConfig(SandboxBase):
    """Tool code in bubblewrap namespaces on this machine (envs/sandbox/process_backend.py)."""

    backend: Literal["process"] = "process"
    """`process`: bubblewrap namespaces on this machine."""
    python: str = "/usr/bin/python3"
    """Interpreter tool code runs with (its prefix is mounted read-only)."""


class DockerSandboxConfig(SandboxBase):
    """Tool code in one container per episode (envs/sandbox/docker_backend.py)."""

    backend: Literal["docker"] = "docker"
    """`docker`: one container per episode."""
    cpus: float = Field(1.0, gt=0, le=256)
    """CPU share of the container (the process backend lowers the tool's priority instead)."""
    docker_image: str = "asyncrl-sandbox:py3"
    """Image of the containers; `scripts/build_sandbox_image.sh` builds it locally."""
    docker_host: str | None = None
    """Docker engine address (e.g. unix:///run/asyncrl-docker/docker.sock); None: $DOCKER_HOST or the default."""
    start_timeout_s: float = Field(60.0, gt=0, le=3600)
    """Longest wait for a container to start or be removed before the sandbox counts as failed."""


SandboxConfig = Annotated[
    Annotated[ProcessSandboxConfig, Tag("process")] | Annotated[DockerSandboxConfig, Tag("docker")],
    choice("backend", "process", "docker"),
]
"""The sandbox section: `backend` picks where tool code runs, and each backend has the fields that apply to it."""
_SANDBOX: TypeAdapter[SandboxConfig] = TypeAdapter(SandboxConfig)
