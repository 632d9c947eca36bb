"""The sandbox interface around the backends: tool messages, failures of the sandbox itself (which
must raise SandboxError, never a tool result), the sweep of leftover containers, the start-up bench."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from pydantic import TypeAdapter
from test_sandbox_hostile import available_config

from asyncrl.configs.schema import DockerSandboxConfig, ProcessSandboxConfig, SandboxConfig
from asyncrl.envs.sandbox import SandboxError, ToolResult, open_backend
from asyncrl.envs.sandbox.bench import sandbox_start_ms

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def docker_config() -> SandboxConfig:
    return available_config("docker")


def test_tool_message_shows_output_then_one_error_line() -> None:
    assert ToolResult("42\n", "", 0).as_tool_message() == "42"
    crash = ToolResult("", "Traceback ...\nZeroDivisionError: division by zero\n", 1)
    assert crash.as_tool_message() == "Traceback ...\nZeroDivisionError: division by zero\n[tool error: exit code 1]"
    loop = ToolResult("partial\n", "", None, timed_out=True, killed="timeout")
    assert loop.as_tool_message() == "partial\n[tool error: killed: the time limit was reached]"
    assert ToolResult("", "", None).as_tool_message() == "[tool error: killed by a signal]"
    assert not loop.ok and ToolResult("1", "", 0).ok


def _open_once(config: SandboxConfig) -> None:
    async def go():
        backend = open_backend(config)
        try:
            async with backend.open() as sandbox:
                await sandbox.run_python("print(1)")
        finally:
            await backend.close()

    asyncio.run(go())


def test_docker_engine_unreachable_is_a_sandbox_error() -> None:
    with pytest.raises(SandboxError, match=r"no Docker engine answers at unix:///nonexistent/docker\.sock"):
        _open_once(DockerSandboxConfig(docker_host="unix:///nonexistent/docker.sock"))


def test_missing_interpreter_is_a_sandbox_error() -> None:
    with pytest.raises(SandboxError, match=r"/nonexistent/python3 is missing|bubblewrap"):
        _open_once(ProcessSandboxConfig(python="/nonexistent/python3"))


def test_missing_docker_image_is_a_sandbox_error(docker_config) -> None:
    with pytest.raises(SandboxError, match=r"asyncrl-sandbox:does-not-exist is missing: run scripts/build_sandbox_image\.sh"):
        _open_once(docker_config.model_copy(update={"docker_image": "asyncrl-sandbox:does-not-exist"}))


def test_container_gone_mid_episode_is_a_sandbox_error(docker_config) -> None:

    async def go():
        backend = open_backend(docker_config)
        try:
            async with backend.open() as sandbox:
                assert (await sandbox.run_python("print(1)")).stdout == "1\n"
                await backend.remove(sandbox._container)  # as if the engine lost it
                with pytest.raises(SandboxError, match="docker exec failed"):
                    await sandbox.run_python("print(2)")
        finally:
            await backend.close()

    asyncio.run(go())


def test_leftover_containers_of_dead_processes_are_swept(docker_config) -> None:
    from asyncrl.envs.sandbox.docker_backend import DockerBackend

    async def go():
        dead = DockerBackend(docker_config)
        dead.labels["asyncrl.sandbox.pid"] = str(2**22 + 1)  # above pid_max: no such process
        alive = DockerBackend(docker_config)  # this process: alive, so it must be left alone
        try:
            orphan = await dead.start_container()
            mine = await alive.start_container()
            fresh = open_backend(docker_config)
            async with fresh.open():  # the first open of a backend sweeps
                pass
            await fresh.close()
            client = await alive._connected()
            ids = {c.id for c in client.containers.list(all=True, filters={"label": "asyncrl.sandbox=1"})}
            assert orphan.id not in ids and mine.id in ids
        finally:
            await dead.close()
            await alive.close()

    asyncio.run(go())


@pytest.mark.parametrize("name", ["process", "docker"])
def test_sandbox_start_ms_measures_every_backend_asked(name) -> None:
    config = available_config(name)
    means = asyncio.run(sandbox_start_ms(config, backends=(name,), runs=1))
    assert set(means) == {name} and means[name] > 0


def test_process_backend_removes_scratch_of_sandboxes_left_open() -> None:
    config = available_config("process")

    async def go():
        backend = open_backend(config)
        closed, left_open = await backend.open(), await backend.open()
        await closed.run_python("open('f', 'w').write('x')")
        await closed.close()
        scratch = [closed._scratch, left_open._scratch]
        assert [p.exists() for p in scratch] == [False, True]
        await backend.close()
        return scratch

    assert not any(p.exists() for p in asyncio.run(go()))


def test_config_rejects_limits_out_of_bounds() -> None:
    with pytest.raises(ValueError):
        ProcessSandboxConfig(memory_mb=1)
    with pytest.raises(ValueError):
        TypeAdapter(SandboxConfig).validate_python({"backend": "vm"})


CHILD_HOOK_PROBE = r"""
import asyncio, os, sys, uvloop
from asyncrl.envs.sandbox.spawn import Child

marker = sys.argv[1]
os.register_at_fork(after_in_child=lambda: open(marker, "a").write("hook ran\n"))

async def main():
    if sys.argv[2] == "asyncio":
        proc = await asyncio.create_subprocess_exec("/bin/echo", "hi", stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
    else:
        out, _ = await Child(["/bin/echo", "hi"], env={}, cwd="/").communicate()
    assert out == b"hi\n", out

uvloop.run(main())
"""


@pytest.mark.parametrize(("spawn", "hook_runs"), [("asyncio", True), ("child", False)])
def test_sandbox_calls_run_no_python_in_the_forked_child_under_uvloop(tmp_path, spawn, hook_runs) -> None:
    """The hang seen in a pipeline's agentic stage: under uvloop, asyncio's subprocesses run the
    interpreter's after-fork hooks in the child (the control case shows it), which can deadlock in
    a threaded driver and block the event loop. The sandbox's own spawn runs none."""
    pytest.importorskip("uvloop")
    marker = tmp_path / "marker"
    subprocess.run([sys.executable, "-c", CHILD_HOOK_PROBE, str(marker), spawn], check=True, timeout=60)
    assert marker.exists() == hook_runs
