"""Kill -9 the rollout worker of a real `asyncrl run` mid-run: a replacement starts, loads the current
weights and version, and only then serves; the run finishes with every rollout in exactly one account.

The run has one engine, so nothing can be sampled until the replacement serves, and the kill leaves
more steps to take than the groups already ahead of the learner can fill: the run can finish only
through the replacement. The engine's actor is also checked to run at the driver's niceness (Ray
starts actors at 15 unless told otherwise, rollout/worker.py RAY_SYSTEM_CONFIG).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

STEPS = 16


def test_a_killed_rollout_worker_is_replaced_and_the_run_finishes(start_run, books, turns, figures):
    run = start_run("worker", f"loop.steps={STEPS}")
    worker = run.wait_for_actor("ray::RolloutWorker")
    assert run.niceness(worker) == run.niceness(), "the rollout worker does not run at the driver's niceness"
    run.wait_until(lambda: run.step() >= 2, "the learner's second step")
    killed_at, step_at_kill = run.kill9(worker), run.step()
    pushed_at_kill = max(r["pushed_version"] for r in run.metrics() if "loss" in r)

    assert run.finish() == 0, run.tail()
    summary = run.summary()
    assert summary["version"] == STEPS and summary["engine_versions"] == [STEPS]  # pushes reach the replacement
    (replaced,) = [r for r in summary["recoveries"] if r["event"] == "worker_replaced"]
    assert (replaced["engine_id"], replaced["replacement"]) == ("worker-rollout-0", "worker-rollout-0-r1")
    assert replaced["version"] >= pushed_at_kill  # it joined serving the latest push, not the weights it was built with

    # It served, and only ever with weights it was pushed since it joined.
    served = turns(run.run_dir)[replaced["replacement"]]
    assert served and min(v for turn in served for v in turn.versions) >= replaced["version"]
    accounts = books(run.run_dir)

    figures("kill_rollout_worker", {
        "detected_s": round(replaced["died_at"] - killed_at, 3),
        "replacement_start_s": round(replaced["recovery_s"], 2),
        "kill_to_serving_s": round(replaced["serving_at"] - killed_at, 2),
        "step_at_kill": step_at_kill, "steps": STEPS, **accounts,
    })  # fmt: skip
