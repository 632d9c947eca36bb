"""`asyncrl pipeline` end to end on a tiny policy: SFT -> Reasoning RL -> distillation, killed with
SIGKILL in the middle of the RL stage and resumed. Real processes throughout (the pipeline runs as a
CLI subprocess with its own Ray, engines, gateway, learner and teacher actors)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

TINY_BASE = {
    "policy": {
        "tiny": {"arch": "qwen3", "hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
        "mtp": {"enabled": False},
    },
    "tasks": {"arithmetic": {"subtraction_fraction": 0.0}},
    "rollout": {"cpus_per_worker": 0.5, "max_num_seqs": 16},
    "learner": {"num_cpus": 0.5, "group_size": 4, "batch_groups": 2, "lr": 1e-3, "checkpoint_every": 2},
    "loop": {"max_inflight": 16, "eval_every": 100, "sft_first": False},
    "eval": {"num_problems": 16, "max_tokens": 4},
    "logging": {"wandb": "disabled", "progress": False},
}
STAGES = {
    "sft": {"kind": "sft", "config": {"sft": {"max_steps": 12, "batch_size": 16, "eval_every": 6, "stop_at_accuracy": None}}},
    # A tiny untrained policy never solves arithmetic; the parity task gives its groups a signal.
    "reasoning": {"kind": "rl", "tasks": {"reasoning": {"env": "loop_helpers:CoinEnv"}}, "config": {"loop": {"steps": 40}}},
    "distill": {"kind": "distill", "config": {"learner": {"group_size": 1, "batch_groups": 4}, "loop": {"steps": 2},
                                              "distill": {"cpus_per_teacher": 0.25}}},
}  # fmt: skip


def start(*args: str, log: Path) -> subprocess.Popen:
    tests = str(Path(__file__).parent)  # the parity task lives beside this file
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "asyncrl", "pipeline", *args], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)  # fmt: skip


def wait_for(predicate, process: subprocess.Popen, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert process.poll() is None, f"the pipeline exited early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


@pytest.fixture
def started():
    """Every pipeline process a test starts; a failed test leaves none running (nor their Ray)."""
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_a_pipeline_killed_mid_stage_resumes_without_redoing_finished_stages(tmp_path, started):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({"name": "tiny", "runs_dir": str(tmp_path), "base": TINY_BASE, "stages": STAGES}, sort_keys=False))
    pipe = tmp_path / "tiny"
    rl_checkpoints = pipe / "reasoning" / "checkpoints"

    first = start(str(config), log=tmp_path / "first.log")
    started.append(first)
    wait_for(lambda: any(rl_checkpoints.glob("step-*/loop_state.json")), first, tmp_path / "first.log")
    os.killpg(first.pid, signal.SIGKILL)  # the whole session: driver, Ray, actors
    first.wait()

    state = json.loads((pipe / "state.json").read_text())
    assert list(state["stages"]) == ["sft"] and list(state["matrix"]) == ["sft"]
    sft_weights = Path(state["stages"]["sft"]["checkpoint"]) / "model.safetensors"
    sft_written = sft_weights.stat().st_mtime_ns
    killed_at = max(json.loads(p.read_text())["version"] for p in rl_checkpoints.glob("step-*/loop_state.json"))
    assert 0 < killed_at < 24

    # Resumed with an override for the stage it stopped in: the pipeline file is the source of truth.
    second = start("--resume", str(pipe), "stages.reasoning.config.loop.steps=24", log=tmp_path / "second.log")
    started.append(second)
    assert second.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()[-3000:]
    out = (tmp_path / "second.log").read_text()

    assert "stage sft (sft): done" in out and sft_weights.stat().st_mtime_ns == sft_written  # not redone
    assert f"resumed at version {killed_at}" in out  # the RL stage continued at its step
    summary = json.loads((pipe / "summary.json").read_text())
    assert list(summary["stages"]) == ["sft", "reasoning", "distill"]
    assert summary["stages"]["reasoning"]["summary"]["version"] == 24
    assert yaml.safe_load((pipe / "pipeline.yaml").read_text())["stages"]["reasoning"]["config"]["loop"]["steps"] == 24
    assert summary["stages"]["reasoning"]["summary"]["balanced"] and summary["stages"]["distill"]["summary"]["balanced"]
    assert summary["tasks"] == ["reasoning"] and list(summary["rows"]) == ["sft", "reasoning", "distill"]
    assert all(0.0 <= row["reasoning"] <= 1.0 for row in summary["rows"].values())
    assert {(c["check"], c["stage"]) for c in summary["checks"]} == {
        ("rl_raises_own_eval", "reasoning"),
        ("student_keeps_teacher", "distill"),
    }
    assert (pipe / "matrix.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((pipe / "matrix.json").read_text())["rows"] == summary["rows"]
    # The distillation stage's teacher was the RL stage's final checkpoint.
    teachers = yaml.safe_load((pipe / "distill" / "config.yaml").read_text())["distill"]["teachers"]
    assert teachers["reasoning"]["checkpoint"] == summary["stages"]["reasoning"]["checkpoint"]
