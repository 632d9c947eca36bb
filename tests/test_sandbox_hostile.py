"""Hostile tool code against both sandbox backends: each attack is contained and reported as a tool
error, the sandbox survives it, and nothing it started outlives the call, the episode or a cancel.

Memory and process limits are tight (128 MB, 16 processes) so the bombs stay small on a shared machine.
The time limit is not: a call's limit counts the interpreter's start at nice 10, which a busy machine
can stretch to seconds, so only code that never ends reaches it (LOOP_LIMIT_S for the infinite loop,
LIMITS' minute for anything else that went wrong). A backend that cannot run here (no bubblewrap, no
Docker engine or image) is skipped with the reason, except under CI=true, where the test script
installs both and a missing one is a failure.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest

from asyncrl.configs.schema import DockerSandboxConfig, ProcessSandboxConfig, SandboxConfig
from asyncrl.envs.sandbox import SandboxError, open_backend

pytestmark = pytest.mark.timeout(120)

LIMITS = dict(timeout_s=60.0, memory_mb=128, max_processes=16, max_output_bytes=4096, scratch_mb=8)
LOOP_LIMIT_S = 10.0
"""The time limit of code that loops forever: it has to be waited out, and what the code prints first
(under a second, on a busy machine) lands far inside it."""
REPO = Path(__file__).resolve().parents[1]
_probed: dict[str, str | None] = {}


def _config(backend: str, **overrides) -> SandboxConfig:
    if backend == "docker":
        return DockerSandboxConfig(docker_host=os.environ.get("DOCKER_HOST"), **{**LIMITS, **overrides})
    return ProcessSandboxConfig(**{**LIMITS, **overrides})


async def _probe(config: SandboxConfig) -> None:
    backend = open_backend(config)
    try:
        async with backend.open() as sandbox:
            result = await sandbox.run_python("print(1)")
        assert result.stdout == "1\n", result
    finally:
        await backend.close()


def unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: scripts/test.sh is expected to provide it)")
    pytest.skip(reason)


def available_config(name: str) -> SandboxConfig:
    """The test limits for backend `name`, after one probe per session that it runs here."""
    if name not in _probed:
        try:
            asyncio.run(_probe(_config(name)))
            _probed[name] = None
        except SandboxError as e:
            _probed[name] = f"{name} sandbox unavailable: {e}"
    if _probed[name]:
        unavailable(_probed[name])
    return _config(name)


@pytest.fixture(params=["process", "docker"])
def config(request) -> SandboxConfig:
    return available_config(request.param)


def run(config: SandboxConfig, *codes: str, timeout_s: float | None = None, event_loop: str = "asyncio"):
    """Run the codes one after another in one sandbox; returns their results. `event_loop`: asyncio's
    own, or uvloop (what `asyncrl run` and `asyncrl serve` use where it is installed)."""

    async def go():
        backend = open_backend(config)
        try:
            async with backend.open() as sandbox:
                return [await sandbox.run_python(code, timeout_s=timeout_s) for code in codes]
        finally:
            await backend.close()

    if event_loop == "uvloop":
        return pytest.importorskip("uvloop").run(go())
    return asyncio.run(go())


def processes_with(marker: str) -> list[int]:
    """Live processes on this machine (containers' included) whose command line holds marker."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_runs_code_and_scratch_lasts_for_the_episode(config) -> None:
    first, second, failing = run(
        config,
        "open('notes.txt', 'w').write('kept'); print(6 * 7)",
        "print(open('/scratch/notes.txt').read())",
        "raise ValueError('bad input')",
    )
    assert (first.stdout, first.exit_code, first.killed) == ("42\n", 0, None)
    assert second.stdout == "kept\n"
    assert failing.exit_code == 1 and "ValueError: bad input" in failing.stderr
    assert failing.as_tool_message().endswith("[tool error: exit code 1]")


@pytest.mark.parametrize("address", [("1.1.1.1", 80), ("127.0.0.1", int(os.environ.get("ASYNCRL_REDIS_PORT", 6379)))])
def test_network_is_unreachable(config, address) -> None:
    code = f"""
import socket
try:
    socket.create_connection({address!r}, timeout=2)
    print("CONNECTED")
except OSError as e:
    print("BLOCKED", e)
"""
    (result,) = run(config, code)
    assert result.stdout.startswith("BLOCKED"), result


def test_writes_outside_scratch_fail_and_host_files_are_hidden(config) -> None:
    code = f"""
import os
for path in ["/usr/evil", "/etc/evil", "/evil", "/usr/bin/python3"]:
    try:
        with open(path, "a") as f:
            f.write("x")
        print("WROTE", path)
    except OSError as e:
        print("DENIED", path, e.errno)
print("HOST REPO VISIBLE" if os.path.exists({str(REPO)!r}) else "HOST REPO HIDDEN")
"""
    (result,) = run(config, code)
    assert "WROTE" not in result.stdout, result
    assert result.stdout.count("DENIED") == 4
    assert "HOST REPO HIDDEN" in result.stdout


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_tool_code_runs_unprivileged(config, event_loop) -> None:
    # As root, RLIMIT_NPROC (the process backend's fork-bomb limit) binds only if the code is not root.
    (result,) = run(config, "import os\nprint(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())", event_loop=event_loop)
    uid, euid, gid, groups = result.stdout.split(" ", 3)
    expected = "65534" if config.backend == "docker" or os.geteuid() == 0 else str(os.getuid())
    assert uid == euid == expected and gid != "0", result
    assert "0" not in groups.strip("[]\n").replace(" ", "").split(","), result


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_fork_bomb_is_contained_and_the_sandbox_survives(config, event_loop) -> None:
    marker = f"bomb-{uuid.uuid4().hex}"
    bomb, after = run(config, f"import os  # {marker}\nwhile True:\n    os.fork()", "print('alive')", event_loop=event_loop)
    # Each child whose fork fails prints a traceback; when enough do so before the parent's own fork
    # fails, they fill the 4 KB output cap first. The process limit still acted: its EAGAIN is there.
    assert bomb.killed in ("pids", "timeout", "output"), bomb
    if bomb.killed == "output":
        assert "Resource temporarily unavailable" in bomb.stderr, bomb
    assert "[tool error:" in bomb.as_tool_message()
    assert after.stdout == "alive\n"
    assert processes_with(marker) == []


def test_memory_bomb_is_stopped_by_the_memory_limit(config) -> None:
    bomb, after = run(config, "blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))", "print('alive')")
    assert bomb.killed == "memory", bomb
    assert "memory limit" in bomb.as_tool_message()
    assert after.stdout == "alive\n"


def test_infinite_loop_is_killed_at_the_time_limit(config) -> None:
    marker = f"loop-{uuid.uuid4().hex}"
    source = f"print('started', flush=True)  # {marker}\nwhile True:\n    pass"
    (result,) = run(config, source, timeout_s=LOOP_LIMIT_S)
    assert result.timed_out and result.killed == "timeout" and result.exit_code is None
    assert result.stdout == "started\n"  # what was printed before the kill still arrives
    assert processes_with(marker) == []


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_gigabytes_of_output_are_cut_at_the_cap(config, stream) -> None:
    (result,) = run(config, f"import sys\nwhile True:\n    sys.{stream}.write('x' * 65536)")
    assert result.truncated and result.killed == "output", result
    assert len(result.stdout) + len(result.stderr) == config.max_output_bytes
    assert result.as_tool_message().endswith("[output truncated]\n[tool error: killed: the output limit was reached]")


def test_detached_processes_do_not_outlive_the_call(config) -> None:
    marker = f"daemon-{uuid.uuid4().hex}"
    code = f"""
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # {marker}"], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("spawned")
"""
    (result,) = run(config, code)
    assert result.stdout == "spawned\n" and result.exit_code == 0
    assert processes_with(marker) == []


def test_cancelled_episode_leaves_nothing_behind(config) -> None:
    marker = f"cancel-{uuid.uuid4().hex}"

    async def go():
        # The call's own limit is out of reach: only the cancel can end the tool code within the test's time.
        backend = open_backend(config.model_copy(update={"timeout_s": 3600.0}))
        try:

            async def episode():
                async with backend.open() as sandbox:
                    await sandbox.run_python(f"import time  # {marker}\nwhile True:\n    time.sleep(0.05)")

            task = asyncio.create_task(episode())
            for _ in range(1200):  # until the tool code runs (a minute at most: a hang guard)
                await asyncio.sleep(0.05)
                if processes_with(marker):
                    break
            assert processes_with(marker), "the tool code never started"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                # A hang guard: cancelling ends the tool code, where the call's limit would take an hour.
                await asyncio.wait_for(task, 60)
            assert processes_with(marker) == []
            if config.backend == "docker":
                assert _containers(backend) == []
        finally:
            await backend.close()

    asyncio.run(go())


def _containers(backend) -> list[str]:
    import docker

    client = docker.DockerClient(base_url=backend.config.docker_host) if backend.config.docker_host else docker.from_env()
    try:
        return [c.id for c in client.containers.list(all=True, filters={"label": f"asyncrl.sandbox.backend={backend.id}"})]
    finally:
        client.close()
