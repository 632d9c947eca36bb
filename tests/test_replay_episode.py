"""`asyncrl replay episode`: recorded episodes re-played through the run's own environments and the real
gateway, with the recorded completions in place of the model.

The first run is a real tiny RL run (the loop, the embedded engine, the learner) over a task mix of
test environments loaded by import path (tests/replay_envs.py) and the built-in reasoning task. The
tool cases need completions that call tools, which the random tiny policy does not write: those
episodes are recorded through the same gateway, store and task mix with a scripted engine that writes
the tool-call text (for the agentic task, its own demonstration rendered by the chat template).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import pytest
from loop_helpers import run_config, run_in_process
from replay_envs import NONCE_CHARS

from asyncrl.cli import main as cli
from asyncrl.envs.runner import run_recorded_episode
from asyncrl.gateway.engines import LocalEngine
from asyncrl.gateway.serving import InProcessGateway
from asyncrl.gateway.store import open_store
from asyncrl.policy.tokenizer import build_tokenizer
from asyncrl.records import GenerationResult
from asyncrl.sched.rundir import RunDir
from asyncrl.sched.tasks import TaskMix

NEEDS_BWRAP = pytest.mark.skipif(
    shutil.which("bwrap") is None and os.environ.get("CI") != "true", reason="the agentic task's sandbox needs bubblewrap"
)
MIX = (
    'tasks.mix={flaky: {env: "replay_envs:FlakyEnv"}, echo: {env: "replay_envs:EchoEnv"}, '
    'lucky: {env: "replay_envs:LuckyEnv"}, math: {env: reasoning}, words: {env: general}}'
)
ONE_SYNC_STEP_OF_FIVE_GROUPS = ("loop.mode=sync", "loop.steps=1", "learner.batch_groups=5", "loop.max_inflight=20")
TOKENIZER = build_tokenizer()


def replay(run_dir, *options: str, json_path=None) -> tuple[int, dict]:
    path = json_path or run_dir.parent / "replay.json"
    code = cli(["replay", "episode", str(run_dir), "--no-progress", "--json", str(path), *options])
    return code, json.loads(path.read_text())


def fingerprint(run_dir) -> str:
    """The store file's contents; a read-only SQLite opening may leave an empty WAL beside it, never a write."""
    wal = run_dir / "trajectories.db-wal"
    assert not wal.exists() or wal.stat().st_size == 0
    return hashlib.sha256((run_dir / "trajectories.db").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory):
    """A real RL run of the tiny policy over flaky, echo, lucky and the built-in reasoning and general tasks:
    one synchronous step of five groups, so exactly one group of each task is played, and all of it trained."""
    config = run_config(tmp_path_factory.mktemp("runs"), "name=mixed", *ONE_SYNC_STEP_OF_FIVE_GROUPS, "eval.num_problems=4", MIX)
    asyncio.run(run_in_process(config, None))
    return RunDir.for_config(config).path


class ScriptedEngine:
    """Writes `script(turn, problem)` (text, rendered special tokens included) as the completion of each call
    of the episode playing `problem`; fails the call, as an engine that died does, where that is None."""

    engine_id = "scripted"

    def __init__(self, script) -> None:
        self.script, self.calls, self.problem = script, {}, None

    async def generate(self, prompt_token_ids, sampling, *, session_id=None) -> GenerationResult:
        turn = self.calls[session_id] = self.calls.get(session_id, -1) + 1
        text = self.script(turn, self.problem)
        if text is None:
            return GenerationResult(f"{session_id}-{turn}", list(prompt_token_ids), [], [], [], "error", error="the engine died")
        ids = TOKENIZER.encode(text, add_special_tokens=False)
        return GenerationResult(f"{session_id}-{turn}", list(prompt_token_ids), ids, [-0.5] * len(ids), [0] * len(ids), "stop")

    def health(self) -> dict:
        return {"alive": True}


def record(tmp_path, task_spec: str, script, seeds: list[int | None]) -> Path:
    """A run directory holding episodes of the one task `task_spec`, played one after the other through the
    real gateway with a scripted engine, each recorded with the task seed it was drawn from (None: without one)."""
    config = run_config(tmp_path, "name=scripted", "gateway.port=0", f"tasks.mix={{t: {task_spec}}}")
    rundir = RunDir.for_config(config)
    rundir.write_config(config)
    store = open_store(rundir.store_address(config), namespace=config.name)
    task = TaskMix.from_config(config).tasks[0]

    engine = ScriptedEngine(script)

    async def go():
        async with InProcessGateway(config, store, [LocalEngine(engine)], TOKENIZER) as gateway:
            for seed in seeds:
                problem = engine.problem = task.env.sample_task(random.Random(seed or 0), "train")
                metadata = {} if seed is None else {"task_seed": seed}
                await run_recorded_episode(task.env, problem, gateway, metadata=metadata, sandboxes=task.sandboxes, task_name=task.name)

    try:
        asyncio.run(go())
    finally:
        store.close()
    return rundir.path


def text(ids: list[int]) -> str:
    return TOKENIZER.decode(ids, skip_special_tokens=False)


def by_task(report: dict) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for rollout in report["rollouts"]:
        found.setdefault(rollout["task"], []).append(rollout)
    return found


def test_replay_finds_the_flaky_message_and_the_lucky_reward_and_nothing_else(rl_run):
    before = fingerprint(rl_run)
    store = open_store(rl_run)
    recorded = {t.rollout_id: t for t in store.list()}
    store.close()
    code, report = replay(rl_run)
    assert code == 2
    assert fingerprint(rl_run) == before  # the run's store is only read
    rollouts = by_task(report)
    assert all(t.status == "ok" for t in recorded.values()) and len(recorded) == len(report["rollouts"]) == 20
    assert {task: len(found) for task, found in rollouts.items()} == {"flaky": 4, "echo": 4, "lucky": 4, "math": 4, "words": 4}
    for rollout in rollouts["flaky"]:
        d, turns = rollout["divergence"], recorded[rollout["rollout_id"]].turns
        assert rollout["verdict"] == "diverged" and d["kind"] == "environment_message" and d["turn"] == 1
        # The nonce starts after turn 0's prompt and completion, the user marker and the prefix; found by text,
        # since the policy may have ended its completion with the user marker itself (the prompt then has one).
        prompt = turns[1].prompt_token_ids
        start = next(i for i in range(len(turns[0].prompt_token_ids), len(prompt)) if text(prompt[:i]).endswith("<|user|>nonce "))
        assert start <= d["position"] < start + NONCE_CHARS
        assert d["recorded"] == text(prompt[d["position"] : d["position"] + 24])
        assert d["replayed"][0] != d["recorded"][0] and d["before"].endswith(TOKENIZER.decode(prompt[start - 6 : d["position"]]))
        assert rollout["turns"][0]["equal"] and not rollout["turns"][1]["equal"]
        for new in (rollout["turns"][1]["recorded_new"], rollout["turns"][1]["replayed_new"]):
            assert re.match(r"(<\|user\|>)?nonce [0-9a-f]{16}", new), new
    for rollout in rollouts["lucky"]:  # every prompt replays; the reward is drawn anew
        d = rollout["divergence"]
        assert d["kind"] == "reward" and d["turn"] is None and all(t["equal"] for t in rollout["turns"])
        assert float(d["recorded"]) == recorded[rollout["rollout_id"]].reward != float(d["replayed"])
    for task in ("echo", "math", "words"):
        for rollout in rollouts[task]:
            t = recorded[rollout["rollout_id"]]
            assert rollout["verdict"] == "ok" and rollout["divergence"] is None
            assert rollout["recorded_turns"] == rollout["replayed_turns"] == len(t.turns) == (2 if task == "echo" else 1)
            assert all(turn["equal"] for turn in rollout["turns"])  # prompts equal token for token
            assert rollout["replayed_outcome"] == rollout["recorded_outcome"] == {"status": "ok", "reward": t.reward, "metrics": t.metrics}
    summary = {s["task"]: s for s in report["tasks"]}
    assert {name for name, s in summary.items() if not s["deterministic"]} == {"flaky", "lucky"}
    assert summary["flaky"]["kinds"] == {"environment_message": len(rollouts["flaky"])} and summary["flaky"]["tools"] == {}


def test_selection_by_rollout_and_task_and_bad_input(rl_run, capsys):
    store = open_store(rl_run)
    echo = next(t for t in store.list() if t.task == "echo" and t.status == "ok")
    store.close()
    code, report = replay(rl_run, "--rollout", echo.rollout_id)
    assert code == 0 and [r["rollout_id"] for r in report["rollouts"]] == [echo.rollout_id]
    code, report = replay(rl_run, "--task", "math", "--limit", "2")
    assert code == 0 and [r["task"] for r in report["rollouts"]] == ["math", "math"]
    trained = [rid for group in RunDir(rl_run).read_batch(1).groups for rid in group]
    code, report = replay(rl_run, "--step", "1")
    assert code == 2 and [r["rollout_id"] for r in report["rollouts"]] == trained and len(trained) == 20
    capsys.readouterr()
    assert cli(["replay", "episode", str(rl_run), "--rollout", "nope"]) == 1
    assert "no rollout 'nope'" in (err := capsys.readouterr().err) and echo.rollout_id[:8] in err  # lists some that exist
    assert cli(["replay", "episode", str(rl_run), "--task", "chess"]) == 1
    assert "task 'chess' is not in the run's config" in capsys.readouterr().err


def test_a_tool_whose_output_is_random_is_named(tmp_path):
    script = lambda turn, _: "<tool_call>dice</tool_call><|endoftext|>" if turn == 0 else "ok<|endoftext|>"  # noqa: E731
    run_dir = record(tmp_path, '{env: "replay_envs:DiceEnv"}', script, [1, 2])
    before = fingerprint(run_dir)
    code, report = replay(run_dir)
    assert code == 2 and fingerprint(run_dir) == before
    for rollout in report["rollouts"]:
        d = rollout["divergence"]
        assert (d["kind"], d["turn"], d["tools"]) == ("tool_output", 1, ["dice"])
        assert rollout["turns"][1]["recorded_new"].startswith("<|observation|><tool_response>rolled ")
    assert report["tasks"] == [
        {"task": "t", "replayed": 2, "diverged": 2, "kinds": {"tool_output": 2}, "tools": {"dice": 2}, "deterministic": False}
    ]


@NEEDS_BWRAP
def test_the_agentic_task_with_its_sandboxed_python_tool_replays_exactly(tmp_path):
    def script(turn, problem):  # the task's own demonstration of the drawn problem, rendered by the chat template
        assistant = [m for m in problem.demonstration() if m["role"] == "assistant"][turn]
        return TOKENIZER.apply_chat_template([assistant], tokenize=False).removeprefix("<|assistant|>")

    run_dir = record(tmp_path, "{env: agentic}", script, [7])
    store = open_store(run_dir)
    [recorded] = store.list()
    store.close()
    assert recorded.reward == 1.0 and recorded.metrics["clean_runs"] == 1 and len(recorded.turns) == 2  # the tool really ran
    code, report = replay(run_dir)
    [rollout] = report["rollouts"]
    assert code == 0 and rollout["verdict"] == "ok" and all(t["equal"] for t in rollout["turns"])
    assert rollout["turns"][1]["replayed_new"].startswith("<|observation|><tool_response>")  # the product, printed by python


def test_a_replay_that_asks_for_more_or_fewer_turns_than_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLAY_TEST_TURNS", "2")
    run_dir = record(tmp_path, '{env: "replay_envs:ChattyEnv"}', lambda turn, _: f"t{turn}<|endoftext|>", [3])
    monkeypatch.setenv("REPLAY_TEST_TURNS", "3")
    code, report = replay(run_dir)
    [rollout] = report["rollouts"]
    d = rollout["divergence"]
    assert code == 2 and (d["kind"], d["turn"], rollout["recorded_turns"], rollout["replayed_turns"]) == ("extra_turn", 2, 2, 3)
    assert d["explanation"] == "the replay asked for a turn the record does not have" and d["replayed"].startswith("<|user|>again ")
    assert rollout["replayed_outcome"]["status"] == "error"  # the engine refused the call the record does not have
    monkeypatch.setenv("REPLAY_TEST_TURNS", "1")
    code, report = replay(run_dir)
    d = report["rollouts"][0]["divergence"]
    assert code == 2 and (d["kind"], d["turn"]) == ("missing_turn", 1) and d["recorded"].startswith("<|user|>again ")


def test_an_episode_whose_engine_failed_replays_to_the_same_error(tmp_path):
    run_dir = record(tmp_path, '{env: "replay_envs:EchoEnv"}', lambda turn, _: None if turn else "x<|endoftext|>", [6])
    store = open_store(run_dir)
    [recorded] = store.list()
    store.close()
    assert recorded.status == "error" and len(recorded.turns) == 1  # the failed second call was never recorded
    code, report = replay(run_dir)
    [rollout] = report["rollouts"]
    assert code == 0 and rollout["verdict"] == "ok" and (rollout["recorded_turns"], rollout["replayed_turns"]) == (1, 1)
    assert rollout["replayed_outcome"]["status"] == "error" and "the replay asked for turn 1" in rollout["reason"]


def test_a_problem_not_drawn_from_its_seed_diverges_in_the_first_prompt(tmp_path):
    run_dir = record(tmp_path, '{env: "replay_envs:UnseededEnv"}', lambda turn, _: "x<|endoftext|>", [4])
    code, report = replay(run_dir)
    [rollout] = report["rollouts"]
    d = rollout["divergence"]
    # <|user|> and then the 13-digit problem: the first digit may agree, some later one differs.
    assert code == 2 and d["kind"] == "prompt" and d["turn"] == 0 and 1 <= d["position"] <= 13 and d["before"].startswith("<|user|>")


def test_rollouts_that_cannot_be_replayed_say_why(tmp_path, capsys):
    run_dir = record(tmp_path, '{env: "replay_envs:EchoEnv"}', lambda turn, _: "x<|endoftext|>", [None, 5])
    store = open_store(run_dir)
    unseeded = next(t for t in store.list() if "task_seed" not in t.metadata)
    store.close()
    assert cli(["replay", "episode", str(run_dir), "--rollout", unseeded.rollout_id]) == 1
    assert "records no task_seed" in capsys.readouterr().err
    code, report = replay(run_dir)  # the seeded one is replayed; the other is skipped, and the report says why
    assert code == 0 and len(report["rollouts"]) == 1 and "records no task_seed" in report["skipped"][0]["reason"]
    # The config no longer has the task the rollouts were recorded under.
    rundir = RunDir(run_dir)
    config = rundir.read_config()
    rundir.write_config(config.model_copy(update={"tasks": config.tasks.model_copy(update={"mix": {}})}))
    assert cli(["replay", "episode", str(run_dir)]) == 1
    assert "its task 't' is not in the run's config" in capsys.readouterr().err
