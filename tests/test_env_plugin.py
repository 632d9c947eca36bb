"""A third-party environment, installed as its own package, found through its entry point and
trained on by `asyncrl run`, with no change to asyncrl: the package (tests/data/asyncrl_plugin_demo)
is pip-installed into a temporary directory that only this test puts on the path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from loop_helpers import TINY  # the tiny policy and loop sizes of the loop's own tests

from asyncrl.gateway.store import open_store

pytestmark = pytest.mark.slow  # pip builds the package (~5-15 s); the run starts Ray and two actors
PACKAGE = Path(__file__).parent / "data" / "asyncrl_plugin_demo"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    source, target = tmp_path_factory.mktemp("src") / "pkg", tmp_path_factory.mktemp("site")
    shutil.copytree(PACKAGE, source)  # the build writes into its source tree; keep the repository clean
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(source)],
        check=True,
    )  # fmt: skip
    return target


def test_the_installed_plugin_is_found_by_name_and_meets_the_contract(site, monkeypatch):
    from asyncrl.envs.registry import load_environment, registered
    from asyncrl.jobs.contract import check_environment

    monkeypatch.syspath_prepend(str(site))
    assert registered()["echo-digit"] == "asyncrl_plugin_demo.env:EchoDigitEnv"
    env = load_environment("echo-digit", {"max_tokens": 3})
    assert type(env).__module__ == "asyncrl_plugin_demo.env" and env.max_tokens == 3
    report = check_environment(env, episodes=3, eval_episodes=3)
    assert len(report.results) == 3 and {t.task for t in report.trajectories} == {"echo-digit"}


def test_asyncrl_run_trains_on_the_plugin_beside_a_builtin_task(site, tmp_path):
    mix = "tasks.mix={echo: {env: echo-digit, options: {max_tokens: 4}}, math: {env: reasoning, eval_problems: 8}}"
    command = [sys.executable, "-m", "asyncrl", "run", "quickstart", *TINY, f"runs_dir={tmp_path}", "name=plug", "loop.steps=2", mix]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "plug"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["version"] == 2 and summary["balanced"] and summary["ledger"]["trained"] > 0
    store = open_store(run_dir)
    assert {t.task for t in store.list()} == {"echo", "math"}  # both tasks' rollouts, one store
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_accuracy/echo" in r and "eval_accuracy/math" in r for r in evals)
