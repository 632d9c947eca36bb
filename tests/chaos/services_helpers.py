"""Services the chaos tests kill: a private Redis server with an append-only file, a private Docker
engine beside the shared one, and the books and figures every kill test checks and writes.

Each service is a child process of the test on its own port or socket and data directory, so a
`kill -9` hits only what the test started and a restart finds exactly the data the kill left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIGURES = REPO / "runs" / "chaos"
SHARED_DOCKER_HOST = os.environ.get("DOCKER_HOST", "unix:///run/asyncrl-docker/docker.sock")
SANDBOX_IMAGE = "asyncrl-sandbox:py3"
# Long enough for a loaded 2-core machine; only a hang ever reaches it (the tests wait for events).
PATIENCE_S = 120.0


def missing(message: str) -> None:
    """A service the suite needs is not there: a failure in CI, a skip on a workstation."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(condition: Callable[[], object], what: str, timeout_s: float = PATIENCE_S, every_s: float = 0.02):
    """Poll `condition` until it returns something truthy (returned); a guard against hangs, not a timing check."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout_s:g} s waiting for {what}")
        time.sleep(every_s)


def record_figures(name: str, figures: dict) -> Path:
    """Write one test's measured figures to runs/chaos/<name>.json (for docs/RELIABILITY.md) and print them."""
    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / f"{name}.json"
    path.write_text(json.dumps({"test": name, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **figures}, indent=1) + "\n")
    print(f"[chaos] {name}: {json.dumps(figures)}")
    return path


def kill9(process: subprocess.Popen) -> None:
    """SIGKILL one process the test started and reap it."""
    process.send_signal(signal.SIGKILL)
    process.wait()


# -- Redis ----------------------------------------------------------------------------------------


class RedisServer:
    """redis-server on a free port with an append-only file in `directory`, fsynced as `appendfsync`
    says (`everysec`: once a second; `always`: before each reply).

    `kill()` is a kill -9; `start()` again brings it back on the same port from the same files.
    """

    def __init__(self, directory: Path, port: int | None = None, appendfsync: str = "everysec") -> None:
        if shutil.which("redis-server") is None:
            missing("redis-server is not installed: the Redis chaos test did NOT run (scripts/services.sh installs it)")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.appendfsync = appendfsync
        self.process: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        argv = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
            "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "", "--daemonize", "no",
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._ready, f"redis-server on port {self.port} (log: {self.directory / 'redis.log'})")
        return self

    def _ready(self) -> bool:
        import redis

        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"redis-server exited with {self.process.returncode}; log: {self.directory / 'redis.log'}")
        client = redis.Redis(port=self.port, socket_timeout=1.0)
        try:
            return client.info("persistence")["loading"] == 0  # answered, and done loading its AOF
        except redis.RedisError:
            return False
        finally:
            client.close()

    def client(self):
        import redis

        return redis.Redis(port=self.port, decode_responses=True)

    def kill(self) -> None:
        assert self.process is not None
        kill9(self.process)
        self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait()
            self.process = None


# -- Docker ---------------------------------------------------------------------------------------


class PrivateDockerd:
    """A second dockerd beside the shared one: its own socket, data root, exec root and pid file, no
    iptables and no bridge (as scripts/services.sh starts the shared one), holding a copy of the
    sandbox image. `kill()` is a kill -9 (its containerd goes with it; the containers' shims stay),
    `start()` again brings it back on the same socket and data, as an init system would."""

    def __init__(self) -> None:
        if os.geteuid() != 0 or shutil.which("dockerd") is None or shutil.which("docker") is None:
            missing("the dockerd chaos test needs root, dockerd and the docker CLI: it did NOT run")
        # Short: unix socket paths (this one, containerd's under the exec root) must fit in 108 bytes.
        self.directory = Path(tempfile.mkdtemp(prefix="asyncrl-dockerd-", dir="/tmp"))
        self.host = f"unix://{self.directory}/docker.sock"
        self.process: subprocess.Popen | None = None

    def start(self) -> PrivateDockerd:
        argv = [
            "dockerd", "--host", self.host, "--data-root", str(self.directory / "data"), "--exec-root", str(self.directory / "exec"),
            "--pidfile", str(self.directory / "dockerd.pid"), "--iptables=false", "--bridge=none",
        ]  # fmt: skip
        log = open(self.directory / "dockerd.log", "ab")  # noqa: SIM115 (the daemon's, closed with it)
        with log:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        wait_for(self._answers, f"dockerd at {self.host} (log: {self.directory / 'dockerd.log'})", every_s=0.1)
        return self

    def docker(self, *args: str, **options) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", *args], env={**os.environ, "DOCKER_HOST": self.host}, capture_output=True, **options)

    def _answers(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            log = (self.directory / "dockerd.log").read_text(errors="replace").splitlines()[-8:]
            raise AssertionError(f"dockerd exited with {self.process.returncode}:\n" + "\n".join(log))
        try:
            return self.docker("version", "--format", "{{.Server.Version}}", timeout=10).returncode == 0
        except subprocess.TimeoutExpired:  # it listens before it serves (restoring containers)
            return False

    def copy_sandbox_image(self) -> None:
        """The sandbox image from the shared engine (built there by scripts/build_sandbox_image.sh)."""
        shared = {**os.environ, "DOCKER_HOST": SHARED_DOCKER_HOST}
        if subprocess.run(["docker", "image", "inspect", SANDBOX_IMAGE], env=shared, capture_output=True).returncode != 0:
            missing(f"{SANDBOX_IMAGE} is not in the Docker engine at {SHARED_DOCKER_HOST}: run scripts/build_sandbox_image.sh")
        save = subprocess.Popen(["docker", "save", SANDBOX_IMAGE], env=shared, stdout=subprocess.PIPE)
        loaded = self.docker("load", stdin=save.stdout)
        save.wait()
        assert save.returncode == 0 and loaded.returncode == 0, loaded.stderr.decode()

    def containers(self) -> list[str]:
        """Ids of every container this engine holds, running or not."""
        return self.docker("ps", "-aq").stdout.decode().split()

    def kill(self) -> None:
        """kill -9 dockerd; returns once the containerd it ran has gone too (it holds the state the next
        dockerd's containerd needs, and goes on its own when its parent dies)."""
        assert self.process is not None
        children = _children(self.process.pid)
        kill9(self.process)
        self.process = None
        wait_for(lambda: not any(map(_running, children)), f"dockerd's children {children} to exit", every_s=0.05)
        # Where no init reaps orphans (a container without one) its containerd stays a zombie, which its
        # pid file makes the next dockerd take for a live containerd and wait on; a host's init reaps it.
        (self.directory / "exec" / "containerd" / "containerd.pid").unlink(missing_ok=True)

    def stop(self) -> None:
        """Remove its containers, stop it, unmount what it left mounted and delete its directory."""
        if self.process is not None:
            if ids := self.containers():
                self.docker("rm", "-f", *ids)
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill9(self.process)
            self.process = None
        # Shims of containers it never stopped (it died, or failed to come back) outlive it: end them and their containers.
        for shim in _processes_mentioning(f"{self.directory}/exec/containerd"):
            for pid in [*_children(shim), shim]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for mount in sorted((m for m in mounts if m.startswith(str(self.directory))), key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True)
        shutil.rmtree(self.directory, ignore_errors=True)


def hold_port_down(port: int, attempts: int) -> None:
    """While a killed server is down, stand on its port and cut the first `attempts` connections made to
    it: returns once that many calls have found the server gone (an outage that clients surely met)."""
    with socket.create_server(("127.0.0.1", port)) as listener:
        listener.settimeout(PATIENCE_S)
        for _ in range(attempts):
            connection, _ = listener.accept()
            connection.close()


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(child) for task in Path(f"/proc/{pid}/task").iterdir() for child in (task / "children").read_text().split()]
    return []


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (a reparented child stays one where nothing reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- a proxy that loses replies -------------------------------------------------------------------


class ReplyDroppingProxy:
    """A TCP proxy to `port` that, once armed, forwards the next request but drops its reply and cuts
    the client's connection: the write was applied and the client cannot know it (what a Redis kill
    between a command and its reply does). Threads, one pair per connection."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.armed = threading.Event()
        self.dropped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while data := source.recv(65536):
                if replies and self.armed.is_set():
                    self.armed.clear()
                    self.dropped.set()
                    break
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):  # shutdown, not just close: it wakes the other direction's thread and sends the FIN
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def close(self) -> None:
        self.listener.close()
