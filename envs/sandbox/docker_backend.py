"""The `docker` backend: one container per episode, one `docker exec` of the supervisor per call.

Each container has no network, a read-only root, tmpfs at /scratch and /tmp, no capabilities, runs
as nobody, and has memory, CPU and pids limits from the cgroup. Its PID 1 is a tiny reaper, so the
supervisor (`runner.py`) can kill every process a call left behind without stopping the container.

Containers are labelled with this backend's id, host and pid. They are removed by the sandbox's
`close` (shielded from cancellation), by the backend's `close`, at interpreter exit, and, for a
process that died without any of those, by the sweep every backend runs when it first connects.
The docker SDK blocks, so its calls run on this backend's own threads.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from asyncrl.configs.schema import DockerSandboxConfig
from asyncrl.envs.sandbox.base import OpeningSandbox, SandboxError, ToolResult
from asyncrl.envs.sandbox.calls import HOST_GRACE_S, read_answer, runner_argv, timed_out_on_host

log = logging.getLogger(__name__)

LABEL = "asyncrl.sandbox"
USER = "65534:65534"
PYTHON = "/usr/bin/python3"  # where scripts/build_sandbox_image.sh puts the interpreter
_REAPER = """
import os, signal
def reap(*_):
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
signal.signal(signal.SIGCHLD, reap)
while True:
    signal.pause()
"""
# Memory the supervisor and the reaper need beside the tool code's own limit.
_OVERHEAD_MB = 64
# Blocking SDK calls in flight at once: every running tool call holds one thread for its duration.
_THREADS = 64


def _docker_errors() -> tuple[type[BaseException], ...]:
    import docker.errors
    import requests.exceptions

    return (docker.errors.DockerException, requests.exceptions.RequestException)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class DockerSandbox:
    def __init__(self, backend: DockerBackend, container) -> None:
        self._backend = backend
        self._container = container
        self._lock = asyncio.Lock()  # one call at a time: the supervisor kills whatever else runs
        self._closed = False

    async def run_python(self, code: str, *, timeout_s: float | None = None) -> ToolResult:
        config = self._backend.config
        timeout_s = config.timeout_s if timeout_s is None else timeout_s
        argv = runner_argv(PYTHON, code, timeout_s=timeout_s, config=config, limit_processes=False)
        async with self._lock:
            if self._closed:
                raise SandboxError("sandbox is closed")
            if self._container is None:  # an earlier call's container was killed; files are gone
                self._container = await self._backend.start_container()
            call = partial(self._container.exec_run, argv, user=USER, workdir="/scratch", demux=True)
            try:
                status, (stdout, stderr) = await asyncio.wait_for(self._backend.blocking(call), timeout_s + HOST_GRACE_S)
            except asyncio.TimeoutError:
                await self._discard_container()
                return timed_out_on_host(timeout_s)
            except _docker_errors() as e:
                raise SandboxError(f"docker exec failed (Docker engine at {self._backend.where}): {e}") from e
            except BaseException:
                await asyncio.shield(self._discard_container())  # cancelled: the exec must not outlive the episode
                raise
            return read_answer(stdout or b"", stderr or b"", status)

    async def _discard_container(self) -> None:
        container, self._container = self._container, None
        if container is not None:
            await self._backend.remove(container)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Not under the lock: removing the container is also what ends a call still running.
        await asyncio.shield(self._discard_container())

    async def __aenter__(self) -> DockerSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class DockerBackend:
    name = "docker"

    def __init__(self, config: DockerSandboxConfig) -> None:
        self.config = config
        self.id = uuid.uuid4().hex[:12]
        self.labels = {LABEL: "1", f"{LABEL}.backend": self.id, f"{LABEL}.host": socket.gethostname(), f"{LABEL}.pid": str(os.getpid())}
        self._client = None
        self._connect_lock = asyncio.Lock()
        self._threads = ThreadPoolExecutor(_THREADS, thread_name_prefix="asyncrl-docker")

    @property
    def where(self) -> str:
        """The engine's address, for messages: a failure names which engine failed."""
        return self.config.docker_host or os.environ.get("DOCKER_HOST", "the default socket")

    async def blocking(self, fn, *args):
        """Run a blocking SDK call on this backend's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, partial(fn, *args))

    def open(self) -> OpeningSandbox:
        return OpeningSandbox(self._open)

    async def _open(self) -> DockerSandbox:
        return DockerSandbox(self, await self.start_container())

    async def start_container(self):
        client = await self._connected()
        c = self.config
        create = partial(
            client.containers.run,
            c.docker_image,
            command=[PYTHON, "-c", _REAPER],
            detach=True,
            labels=self.labels,
            user=USER,
            hostname="sandbox",
            network_mode=None if c.network else "none",
            mem_limit=f"{c.memory_mb + _OVERHEAD_MB}m",
            memswap_limit=f"{c.memory_mb + _OVERHEAD_MB}m",  # equal to mem_limit: no swap
            nano_cpus=int(c.cpus * 1e9),
            pids_limit=c.max_processes + 2,  # + the reaper and the supervisor
            read_only=True,
            tmpfs={"/scratch": f"rw,size={c.scratch_mb}m,mode=1777", "/tmp": f"rw,size={c.scratch_mb}m,mode=1777"},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            ipc_mode="private",
            working_dir="/scratch",
            # The reaper, as PID 1, ignores SIGTERM: a stop (a restarted dockerd stopping the containers it
            # finds) would wait out the 10 s stop timeout first. Nothing in a sandbox needs a graceful stop.
            stop_signal="SIGKILL",
        )
        starting = asyncio.ensure_future(self.blocking(create))
        try:
            return await asyncio.wait_for(asyncio.shield(starting), c.start_timeout_s)
        except asyncio.TimeoutError as e:
            starting.add_done_callback(self._remove_late)
            raise SandboxError(f"container did not start within {c.start_timeout_s} s") from e
        except asyncio.CancelledError:
            # The SDK call runs on regardless; the container it makes belongs to nobody but us.
            starting.add_done_callback(self._remove_late)
            raise
        except _docker_errors() as e:
            raise SandboxError(f"could not start a sandbox container from {c.docker_image} (Docker engine at {self.where}): {e}") from e

    def _remove_late(self, starting: asyncio.Future) -> None:
        if not starting.cancelled() and starting.exception() is None:
            self._threads.submit(partial(starting.result().remove, force=True))

    async def remove(self, container) -> None:
        try:
            await self.blocking(partial(container.remove, force=True))
        except _docker_errors() as e:
            if getattr(e, "status_code", None) != 404:  # already gone is what we wanted
                log.warning("could not remove sandbox container %s (swept at the next start): %s", container.id[:12], e)

    async def _connected(self):
        async with self._connect_lock:
            if self._client is None:
                self._client = await self.blocking(self._connect)
                atexit.register(self._remove_own)
        return self._client

    def _connect(self):
        try:
            import docker
        except ImportError as e:
            raise SandboxError("the docker SDK is missing: pip install 'asyncrl[docker]'") from e
        c = self.config
        options = {"version": "auto", "timeout": int(c.start_timeout_s), "max_pool_size": _THREADS}
        try:
            client = docker.DockerClient(base_url=c.docker_host, **options) if c.docker_host else docker.from_env(**options)
            client.ping()
        except _docker_errors() as e:
            raise SandboxError(f"no Docker engine answers at {self.where}: {e}") from e
        try:
            client.images.get(c.docker_image)
        except docker.errors.ImageNotFound as e:
            raise SandboxError(f"sandbox image {c.docker_image} is missing: run scripts/build_sandbox_image.sh") from e
        except _docker_errors() as e:
            raise SandboxError(f"could not inspect sandbox image {c.docker_image}: {e}") from e
        self._sweep(client)
        return client

    def _sweep(self, client) -> None:
        """Remove sandbox containers left on this host by processes that are gone."""
        filters = {"label": [f"{LABEL}=1", f"{LABEL}.host={self.labels[f'{LABEL}.host']}"]}
        for container in client.containers.list(all=True, filters=filters):
            pid = container.labels.get(f"{LABEL}.pid", "")
            if not (pid.isdigit() and _alive(int(pid))):
                log.info("removing leftover sandbox container %s", container.id[:12])
                try:
                    container.remove(force=True)
                except _docker_errors():
                    pass

    def _remove_own(self) -> None:
        if self._client is None:
            return
        try:
            for container in self._client.containers.list(all=True, filters={"label": f"{LABEL}.backend={self.id}"}):
                container.remove(force=True)
        except _docker_errors() as e:
            log.warning("could not remove this backend's sandbox containers: %s", e)

    async def close(self) -> None:
        """Remove every container this backend started and release its connection."""
        if self._client is not None:
            await self.blocking(self._remove_own)
            atexit.unregister(self._remove_own)
            self._client.close()
            self._client = None
        self._threads.shutdown(wait=False)
