"""Kill -9 the Docker engine under a real agentic `asyncrl run` whose tool calls run in Docker sandboxes,
and restart it as an init system would.

The run (tests/chaos/conftest.py: `asyncrl run` in its own session) trains on `SandboxParity`, a tool
task: each episode gets a container of its own from the `docker` sandbox backend, asks the policy
once, and runs tool code in its container that computes the reward. The engine is a private dockerd
beside the shared one (services_helpers.PrivateDockerd). After the run's first checkpoint the test
closes a gate that holds each episode reaching its tool call, its container up; once a group's worth
hold one, dockerd is killed, the gate opens (those tool calls meet the dead engine), dockerd stays
down until as many new episodes have failed to start their container, and it comes back.

Every episode that lost its sandbox, or never got one, ends `env_crash` with the engine's address in
its reason and is accounted (dropped by the learner as a crash, or aborted when the run ends before
its group is trained): none is lost. The run finishes with its books balanced from the store and
the checkpoints, and leaves no container behind.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from services_helpers import PrivateDockerd

from asyncrl.envs.base import EpisodeResult

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

STEPS = 6
HELD = 4
"""Episodes holding a live container at the kill (a group's worth), and as many that then fail to start one."""
LOST_SANDBOX, NEVER_STARTED = "docker exec failed", "could not start a sandbox container"
"""How the docker backend's SandboxError begins for a tool call whose engine died, and for a container that cannot start."""


class SandboxParity:
    """The parity of the policy's reply, computed by tool code in the episode's sandbox, is the reward
    (a random policy's groups have signal). `gate`: a directory; while it holds a file `closed`, an
    episode reaching its tool call leaves a file `held-*` there and waits."""

    name = "sandbox-parity"
    needs_sandbox = True

    def __init__(self, gate: str) -> None:
        self.gate = Path(gate)

    def sample_task(self, rng, split="train") -> int:
        return rng.randrange(1_000_000)

    async def run_episode(self, task: int, client, sandbox) -> EpisodeResult:
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": str(task)}], max_tokens=4, temperature=1.0
        )
        if (self.gate / "closed").exists():
            (self.gate / f"held-{uuid.uuid4().hex}").touch()
            while (self.gate / "closed").exists():
                await asyncio.sleep(0.05)
        text = reply.choices[0].message.content or ""
        result = await sandbox.run_python(f"print(sum(map(ord, {text!r})) % 2)")
        if not result.ok:
            raise RuntimeError(f"the tool call failed: {result}")
        return EpisodeResult(reward=float(result.stdout.strip()))


@pytest.fixture
def dockerd():
    engine = PrivateDockerd().start()
    try:
        engine.copy_sandbox_image()
        yield engine
    finally:
        engine.stop()


def test_an_agentic_run_whose_dockerd_is_killed_marks_the_lost_episodes_and_finishes(dockerd, start_run, store, books, figures, tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    tasks = ["tasks.mix.tool.env=test_kill_dockerd:SandboxParity", f"tasks.mix.tool.options.gate={gate}", "tasks.mix.tool.eval_problems=0"]
    sandbox = ["sandbox.backend=docker", f"sandbox.docker_host={dockerd.host}", "sandbox.cpus=0.5", "sandbox.memory_mb=64"]
    # max_staleness 1, as the agentic preset has it: at most one batch finishes ahead of the learner, so the
    # steps after the kill need episodes begun after it.
    run = start_run("dockerd", f"loop.steps={STEPS}", "learner.max_staleness=1", *sandbox, tasks=tasks)
    run.wait_until(lambda: run.committed() >= 2, "the first checkpoint")
    (gate / "closed").touch()
    run.wait_until(lambda: len(list(gate.glob("held-*"))) >= HELD, f"{HELD} episodes holding a live sandbox")
    trajectories = store(run.run_dir)

    def crashed(reason: str) -> int:
        return sum(t.reason.startswith(f"SandboxError: {reason}") for t in trajectories.list(status="env_crash"))

    killed_at = time.time()
    dockerd.kill()
    held = len(list(gate.glob("held-*")))
    (gate / "closed").unlink()
    run.wait_until(lambda: crashed(LOST_SANDBOX) >= held and crashed(NEVER_STARTED) >= HELD, "episodes meeting the dead engine")
    starting = time.time()
    dockerd.start()
    restarted_at = time.time()

    assert run.finish() == 0, run.tail()
    summary, counts, recorded = run.summary(), trajectories.counts(), trajectories.list()
    lost_sandbox, never_started = crashed(LOST_SANDBOX), crashed(NEVER_STARTED)
    trajectories.close()
    assert summary["version"] == STEPS and summary["engine_versions"] == [STEPS]
    failed = [t for t in recorded if t.status == "env_crash"]
    for trajectory in failed:  # each marked, with the sandbox's failure and the engine that failed as the reason
        assert trajectory.reason.startswith("SandboxError") and dockerd.host in trajectory.reason, trajectory.reason
    accounts = books(run.run_dir)
    ledger = accounts["ledger"]
    # A crash is dropped by the learner, or aborted as untrained when the run ends first: one account either way.
    untrained = ledger["aborted"] - counts["aborted"]
    assert 0 < ledger["dropped_crash"] <= len(failed) <= ledger["dropped_crash"] + untrained, (ledger, counts)
    # Recovered: an episode begun after the kill could only get its container from the restarted engine.
    recovered = [t.finished_at for t in recorded if t.status == "ok" and t.created_at > killed_at]
    assert recovered, "no episode begun after the kill succeeded: the run finished on rollouts from before it"
    assert dockerd.containers() == [], "the run left sandbox containers behind"

    first_ok = min(recovered)
    figures("kill_dockerd", {
        "dockerd_down_s": round(restarted_at - killed_at, 2), "dockerd_start_s": round(restarted_at - starting, 2),
        "restart_to_first_tool_call_s": round(first_ok - starting, 2), "kill_to_first_tool_call_s": round(first_ok - killed_at, 2),
        "held_at_kill": held, "lost_sandbox": lost_sandbox, "never_started": never_started, "env_crash": len(failed),
        "steps": STEPS, **accounts,
    })  # fmt: skip
