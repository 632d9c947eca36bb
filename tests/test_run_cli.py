"""`asyncrl run` on the command line: the resolved config, resume's config, refusals."""

from __future__ import annotations

import yaml

from asyncrl.cli import format_summary, main
from asyncrl.configs import load_config
from asyncrl.sched.rundir import RunDir


def test_run_dry_run_prints_the_loop_section(capsys):
    assert main(["run", "quickstart", "loop.mode=sync", "loop.steps=7", "--dry-run"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["loop"]["mode"] == "sync" and resolved["loop"]["steps"] == 7


def test_resume_dry_run_reads_the_run_directory(tmp_path, capsys):
    RunDir(tmp_path / "x").write_config(load_config("quickstart", ["name=x", "loop.steps=5"]))
    assert main(["run", "--resume", str(tmp_path / "x"), "loop.steps=9", "--dry-run"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["name"] == "x" and resolved["loop"]["steps"] == 9


def test_run_refuses_without_config_and_a_run_directory_twice(tmp_path, capsys):
    assert main(["run"]) == 2
    run_dir = tmp_path / "quickstart"
    (run_dir / "checkpoints").mkdir(parents=True)
    assert main(["run", "quickstart", f"runs_dir={tmp_path}", "loop.sft_first=false"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["run", "--resume", str(tmp_path / "nothing")]) == 2


def test_max_inflight_must_hold_a_group():
    import pytest

    from asyncrl.configs import ConfigError

    with pytest.raises(ConfigError, match=r"max_inflight must be at least learner\.group_size"):
        load_config("quickstart", ["loop.max_inflight=4", "learner.group_size=8"])


def test_summary_prints_the_ledger():
    ledger = {"trained": 5, "dropped_stale": 1, "dropped_crash": 1, "dropped_group": 0, "aborted": 1, "started": 8}
    text = format_summary({"run_dir": "r", "mode": "async", "version": 3, "wall_s": 9.0, "eval_before": 0.25,
                           "eval_after": 0.5, "ledger": ledger, "balanced": True})  # fmt: skip
    assert "25.0% before RL -> 50.0% after" in text and "= 8 of 8 started (balanced)" in text


def test_a_run_that_learned_nothing_says_so_and_exits_1(monkeypatch, tmp_path, capsys):
    import asyncrl.jobs.run

    ledger = {"trained": 24, "dropped_stale": 0, "dropped_crash": 0, "dropped_group": 0, "aborted": 0, "started": 24}
    summary = {"run_dir": "r", "mode": "sync", "version": 0, "wall_s": 9.0, "eval_before": 0.0, "eval_after": 0.0,
               "ledger": ledger, "balanced": True, "stop_reason": "no_signal"}  # fmt: skip
    monkeypatch.setattr(asyncrl.jobs.run, "run", lambda *args, **kwargs: summary)
    assert main(["run", "quickstart", f"runs_dir={tmp_path}", "loop.sft_first=false"]) == 1
    assert "stopped early: loop.max_batches_without_step" in capsys.readouterr().out
    monkeypatch.setattr(asyncrl.jobs.run, "run", lambda *args, **kwargs: {**summary, "stop_reason": "wall_budget"})
    assert main(["run", "quickstart", f"runs_dir={tmp_path}", "loop.sft_first=false"]) == 0
    assert "stopped early" not in capsys.readouterr().out
