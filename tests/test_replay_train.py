"""`asyncrl replay train`: a real recorded run's learner steps re-run from their checkpoints reproduce what the
run logged, and what cannot be replayed says why."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import shutil

import pytest
from loop_helpers import CoinEnv, run_config, run_in_process

from asyncrl.cli import main as cli
from asyncrl.learner.rl import RLLearner
from asyncrl.replay.run import ReplayError, RunView
from asyncrl.replay.train import TOLERANCE, _batch, replay_step
from asyncrl.sched.rundir import RunDir


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A real run of 4 learner steps with checkpoints at versions 2 and 4, every batch recorded."""
    config = run_config(tmp_path_factory.mktemp("runs"), "learner.checkpoint_every=2", "loop.steps=4")
    result = asyncio.run(run_in_process(config, CoinEnv()))
    assert result["state"].version == 4
    return result["rundir"].path


@pytest.fixture
def copy(recorded, tmp_path):
    """A copy of the recorded run to damage."""
    return shutil.copytree(recorded, tmp_path / "copy")


def _store_bytes(run) -> str:
    """The store's content: the database and its write-ahead log. A read-only SQLite reader may create an
    empty log and the shared-memory index beside a WAL database; neither holds data."""
    files = [run / "trajectories.db", run / "trajectories.db-wal"]
    return "".join(hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.exists() and p.stat().st_size)


@pytest.mark.parametrize(("step", "start", "steps"), [(1, "start", [1]), (2, "start", [1, 2]), (3, "v2", [3]), (4, "v2", [3, 4])])
def test_a_replayed_step_reproduces_the_logged_loss_and_grad_norm(recorded, step, start, steps) -> None:
    before = _store_bytes(recorded)
    with RunView.open(recorded) as view:
        report = replay_step(view, step, top=5)
        logged = view.step_metrics(step)
        record = view.batch(step)
    assert (report.started_from, report.replayed_steps) == (start, steps)
    assert list(report.on_the_way) == steps[:-1] and all(d is not None and d <= TOLERANCE for d in report.on_the_way.values())
    assert logged is not None and report.logged["loss"] == logged["loss"] and report.logged["grad_norm"] == logged["grad_norm"]
    assert abs(report.replayed["loss"] - logged["loss"]) <= TOLERANCE
    assert abs(report.replayed["grad_norm"] - logged["grad_norm"]) <= TOLERANCE and logged["grad_norm"] > 0.01
    assert report.matches and all(report.differences[k] is not None for k in ("loss", "grad_norm"))
    assert report.replayed["ledger"] == logged["ledger"] == record.ledger
    assert report.replayed["padded"] == logged["padded"] and report.differences["masked_token_frac"] == 0.0
    # The shares split the loss: one per row of the step, adding up to it.
    assert len(report.samples) == record.ledger["trained"] + record.padded > 0
    assert abs(sum(s.loss_share for s in report.samples) - report.replayed["loss"]) <= TOLERANCE
    assert all(s.loss_share == 0.0 for s in report.samples if not s.computed)
    shares = [abs(t.loss_share) for t in report.top_tokens]
    assert len(shares) == 5 and shares == sorted(shares, reverse=True)
    assert _store_bytes(recorded) == before  # replay never writes into the run


def test_the_comparison_can_fail_a_step_run_from_the_wrong_weights_differs(recorded) -> None:
    with RunView.open(recorded) as view:
        record = view.batch(2)
        learner = RLLearner.from_config(view.config)  # the starting policy: step 1 never applied
        step = learner.train_step(_batch(view, record), current_version=record.learner_version)
    assert abs(step.grad_norm - record.grad_norm) > 1e-3


def test_the_command_line_prints_the_comparison_and_writes_json(recorded, tmp_path, capsys) -> None:
    out = tmp_path / "step3.json"
    assert cli(["replay", "train", str(recorded), "--step", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "learner step 3" in printed and "from v2" in printed and "match the log" in printed
    report = json.loads(out.read_text())
    # The record of the optimizer step that made version 3. A later step whose groups all had equal
    # rewards takes no optimizer step and logs under the same version (`stepped: false`, loss 0.0).
    records = [json.loads(line) for line in (recorded / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if r.get("step") == 3 and "loss" in r and "event" not in r and r["stepped"]]
    assert len(logged) == 1 and report["logged"]["loss"] == logged[0]["loss"] == RunDir(recorded).read_batch(3).loss
    assert report["matches"] and abs(report["replayed"]["loss"] - logged[0]["loss"]) <= TOLERANCE
    assert report["samples"] and report["top_tokens"] and report["tolerance"] == TOLERANCE


def test_a_step_logged_again_without_stepping_is_compared_with_the_record_that_stepped(copy) -> None:
    """What the loop logs under version 3 after step 3: a step with only equal-reward groups (no optimizer
    step, loss 0.0, no grad norm), an evaluation and a resume event; the replay compares with step 3's own."""
    metrics = copy / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    stepped = next(r for r in records if r.get("step") == 3 and r.get("stepped"))
    idle = {**stepped, "stepped": False, "loss": 0.0, "grad_norm": None, "skipped_zero_adv": stepped["samples"]}
    later = [idle, {"step": 3, "eval_accuracy": 0.5}, {"event": "resumed", "step": 3, "loss": 0.0}]
    metrics.write_text(metrics.read_text() + "".join(json.dumps(r) + "\n" for r in later))
    with RunView.open(copy) as view:
        assert view.step_metrics(3) == stepped
        report = replay_step(view, 3, top=1)
    assert report.logged["loss"] == stepped["loss"] and report.logged["grad_norm"] == stepped["grad_norm"] is not None
    assert report.matches and report.differences["loss"] <= TOLERANCE


def test_an_unknown_step_lists_the_recorded_ones(recorded, capsys) -> None:
    with RunView.open(recorded) as view, pytest.raises(ReplayError, match=r"recorded steps are 1, 2, 3, 4"):
        replay_step(view, 9)
    assert cli(["replay", "train", str(recorded), "--step", "9"]) == 1
    assert "no batch of learner step 9" in capsys.readouterr().err


def test_a_missing_batch_names_loop_record_batches(copy) -> None:
    (copy / "batches" / "step-000003.json").unlink()
    with RunView.open(copy) as view, pytest.raises(ReplayError, match=r"batch of step 3, which was not recorded \(loop.record_batches\)"):
        replay_step(view, 4)
    shutil.rmtree(copy / "batches")
    with RunView.open(copy) as view, pytest.raises(ReplayError, match=r"loop.record_batches=true"):
        replay_step(view, 2)


def test_a_deleted_checkpoint_is_replayed_around_or_names_the_setting_that_would_have_kept_it(copy) -> None:
    assert cli(["replay", "prune", str(copy), "--checkpoints", "--keep-last", "1"]) == 0
    assert sorted(RunDir(copy).complete_checkpoints()) == [4]
    with RunView.open(copy) as view:
        report = replay_step(view, 3)  # every batch since the start is there: replayed from it
    assert (report.started_from, report.replayed_steps) == ("start", [1, 2, 3]) and report.matches
    (copy / "batches" / "step-000001.json").unlink()
    kept_by = r"checkpoint v2 .*learner.keep_checkpoints_every=2 would have kept it"
    with RunView.open(copy) as view, pytest.raises(ReplayError, match=kept_by):
        replay_step(view, 3)


def test_pruned_trajectories_name_store_keep_trajectories(copy) -> None:
    assert cli(["replay", "prune", str(copy), "--trajectories"]) == 0
    with RunView.open(copy) as view, pytest.raises(ReplayError, match=r"no longer in the store.*store.keep_trajectories=false"):
        replay_step(view, 2)


def test_a_distillation_step_is_refused(copy) -> None:
    rundir = RunDir(copy)
    record = rundir.read_batch(3)
    assert record is not None
    rundir.write_batch(dataclasses.replace(record, distilled=True))
    with RunView.open(copy) as view, pytest.raises(ReplayError, match=r"step 3 was a distillation step"):
        replay_step(view, 4)


def test_a_run_without_record_batches_writes_none(tmp_path) -> None:
    config = run_config(tmp_path, "loop.record_batches=false", "loop.steps=1")
    result = asyncio.run(run_in_process(config, CoinEnv()))
    assert result["state"].version == 1 and not result["rundir"].batches.exists()
