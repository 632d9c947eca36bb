"""Kill -9 the learner actor (or a rank of a data-parallel learner) of a real `asyncrl run` mid-run, after
a checkpoint and at least one step past it: the driver restarts the learner from that checkpoint (the
run's commit point) and the run finishes, with the dead learner's steps since the checkpoint undone and
their rollouts trained once by the new learner (sched/recovery.py `Recovery.restart_learner`)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

STEPS = 12


def test_a_killed_learner_restarts_from_the_last_checkpoint_and_the_run_finishes(start_run, books, figures):
    run = start_run("learner", f"loop.steps={STEPS}", "learner.checkpoint_every=2")
    learner = run.wait_for_actor("ray::LearnerActor")
    assert run.niceness(learner) == run.niceness(), "the learner does not run at the driver's niceness"
    run.wait_until(lambda: run.step() > run.committed() >= 2, "a learner step past a checkpoint")
    killed_at, step_at_kill, committed_at_kill = run.kill9(learner), run.step(), run.committed()

    assert run.finish() == 0, run.tail()
    summary = run.summary()
    assert summary["version"] == STEPS and summary["engine_versions"] == [STEPS]
    (restarted,) = [r for r in summary["recoveries"] if r["event"] == "learner_restarted"]
    # From the newest checkpoint there was (one more may have been written between the look and the kill).
    assert restarted["checkpoint"].endswith(f"step-{restarted['step']:06d}") and restarted["step"] >= committed_at_kill
    assert restarted["recovered"] > 0  # what the dead learner had not committed was claimed again
    accounts = books(run.run_dir)

    figures("kill_learner", {
        "detected_s": round(restarted["detected_at"] - killed_at, 3),
        "restart_s": round(restarted["recovery_s"], 2),
        "kill_to_training_s": round(restarted["serving_at"] - killed_at, 2),
        "step_at_kill": step_at_kill, "restarted_at_step": restarted["step"], "reclaimed": restarted["recovered"],
        "steps": STEPS, **accounts,
    })  # fmt: skip


def test_a_killed_rank_of_a_data_parallel_learner_restarts_the_group(start_run, books):
    run = start_run("learner-dp", f"loop.steps={STEPS}", "learner.checkpoint_every=2", "learner.num_ranks=2")
    peer = run.wait_for_actor("ray::LearnerPeer")
    run.wait_until(lambda: run.step() > run.committed() >= 2, "a learner step past a checkpoint")
    run.kill9(peer)

    assert run.finish() == 0, run.tail()
    summary = run.summary()
    assert summary["version"] == STEPS and summary["engine_versions"] == [STEPS]
    # Rank 0 went down with its peer, and the loop restarted the whole group from the checkpoint.
    assert [r["event"] for r in summary["recoveries"]] == ["learner_restarted"]
    books(run.run_dir)
