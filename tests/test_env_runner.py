"""The runner's sandbox lifecycle: one sandbox per episode for environments that need one, closed
whatever happens, a failing sandbox ending the episode as env_crash (and recorded so). The backend
here is a fake with the SandboxBackend shape, to count opens and closes and to fail on demand."""

from __future__ import annotations

import asyncio

import pytest
from gateway_helpers import LiveGateway, make_engine, make_service, scripted_model

from asyncrl.envs.base import EpisodeResult
from asyncrl.envs.runner import play_episode, run_recorded_episode
from asyncrl.envs.sandbox import SandboxError, ToolResult
from asyncrl.gateway.client import AsyncGatewayClient
from asyncrl.gateway.store import open_store
from asyncrl.policy.tokenizer import ASSISTANT, EOS


class FakeSandbox:
    def __init__(self, backend: FakeBackend) -> None:
        self.backend, self.closed = backend, False

    async def run_python(self, code: str, *, timeout_s: float | None = None) -> ToolResult:
        if self.backend.fail_run:
            raise SandboxError("container vanished")
        return ToolResult(stdout=f"ran {code}\n", stderr="", exit_code=0)

    async def close(self) -> None:
        self.closed = True
        self.backend.closed += 1


class FakeBackend:
    name = "fake"

    def __init__(self, fail_open: bool = False, fail_run: bool = False) -> None:
        self.fail_open, self.fail_run = fail_open, fail_run
        self.opened = self.closed = 0

    async def open(self) -> FakeSandbox:
        if self.fail_open:
            raise SandboxError("engine gone")
        self.opened += 1
        return FakeSandbox(self)


class ToolEnv:
    """Runs one tool call; `mode` makes it raise or hang after the call."""

    name = "tool"
    needs_sandbox = True

    def __init__(self, mode: str = "ok", call_model: bool = False) -> None:
        self.mode, self.call_model, self.seen = mode, call_model, None

    def sample_task(self, rng, split="train"):
        return "print(1)"

    async def run_episode(self, task, client, sandbox) -> EpisodeResult:
        self.seen = sandbox
        if self.call_model:
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        result = await sandbox.run_python(task)
        if self.mode == "raise":
            raise ValueError("bug in the environment")
        if self.mode == "hang":
            await asyncio.sleep(30)
        return EpisodeResult(1.0, metrics={"output": result.as_tool_message()})


class NoToolEnv:
    """An environment that declares no sandbox and takes no sandbox parameter."""

    name = "plain"

    async def run_episode(self, task, client) -> EpisodeResult:
        return EpisodeResult(0.5)


def play(env, backend, timeout_s: float = 300.0) -> EpisodeResult:
    """`timeout_s`: the episode's limit; the default (run_recorded_episode's) only an episode that hangs meets."""
    return asyncio.run(play_episode(env, "print(1)", client=None, sandboxes=backend, timeout_s=timeout_s))


def test_a_sandbox_per_episode_opened_passed_and_closed():
    backend, env = FakeBackend(), ToolEnv()
    results = [play(env, backend) for _ in range(3)]
    assert [r.status for r in results] == ["ok"] * 3 and results[0].metrics["output"] == "ran print(1)"
    assert backend.opened == backend.closed == 3 and env.seen.closed


@pytest.mark.parametrize(("mode", "status", "reason"), [("raise", "env_crash", "bug in the environment"), ("hang", "timeout", "exceeded")])
def test_the_sandbox_is_closed_when_the_episode_fails(mode, status, reason):
    backend = FakeBackend()
    result = play(ToolEnv(mode), backend, **({"timeout_s": 0.3} if mode == "hang" else {}))
    assert result.status == status and reason in result.reason
    assert backend.opened == backend.closed == 1


@pytest.mark.parametrize(("backend", "reason"), [(FakeBackend(fail_open=True), "SandboxError: engine gone"),
                                                 (FakeBackend(fail_run=True), "SandboxError: container vanished"),
                                                 (None, "needs a sandbox and no sandbox backend")])  # fmt: skip
def test_a_failing_or_missing_sandbox_is_an_env_crash(backend, reason):
    result = play(ToolEnv(), backend)
    assert result.status == "env_crash" and reason in result.reason and result.reward == 0.0
    if backend is not None:
        assert backend.opened == backend.closed  # what was opened was closed


def test_an_environment_without_tools_gets_no_sandbox():
    backend = FakeBackend()
    assert play(NoToolEnv(), backend).reward == 0.5 and backend.opened == 0


def test_a_sandbox_crash_is_recorded_as_env_crash_under_the_task_name(tmp_path):
    engine = make_engine("e0", scripted_model([ASSISTANT, "7", EOS]))
    store = open_store(tmp_path)

    async def go(live):
        client = AsyncGatewayClient(live.url, token=live.run_token)
        try:
            env = ToolEnv(call_model=True)
            ok = await run_recorded_episode(env, "x", client, sandboxes=FakeBackend(), task_name="tools-a")
            crashed = await run_recorded_episode(env, "x", client, sandboxes=FakeBackend(fail_run=True), task_name="tools-b")
            return ok, crashed
        finally:
            await client.aclose()

    try:
        with LiveGateway(make_service(store, [engine])) as live:
            (ok_id, _), (crash_id, _) = asyncio.run(go(live))
        ok, crashed = store.get(ok_id), store.get(crash_id)
        assert (ok.status, ok.task, ok.reward, len(ok.turns)) == ("ok", "tools-a", 1.0, 1)
        assert (crashed.status, crashed.task, crashed.reward) == ("env_crash", "tools-b", 0.0)
    finally:
        engine.shutdown()


class SlowOpenLifecycle:
    """A lifecycle whose open completes only when released, like a store write finishing in its thread
    after the episode was cancelled."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.aborted: list[tuple[str, str]] = []

    async def open_rollout(self, **request):
        from asyncrl.lifecycle import Rollout

        await asyncio.shield(self.release.wait())
        return Rollout("r-slow", "rk-x", "http://127.0.0.1:9/v1")

    async def abort(self, rollout_id, reason=""):
        self.aborted.append((rollout_id, reason))

    async def finish(self, *args, **kwargs):
        raise AssertionError("a cancelled episode is never finished")


def test_an_episode_cancelled_while_its_rollout_opens_aborts_the_rollout_once_open():
    async def main():
        lifecycle = SlowOpenLifecycle()
        episode = asyncio.create_task(run_recorded_episode(NoToolEnv(), None, lifecycle))
        await asyncio.sleep(0)  # the episode is now waiting on the open
        episode.cancel()
        await asyncio.sleep(0)
        lifecycle.release.set()  # the open completes after the cancellation
        with pytest.raises(asyncio.CancelledError):
            await episode
        return lifecycle.aborted

    assert asyncio.run(main()) == [("r-slow", "cancelled")]
