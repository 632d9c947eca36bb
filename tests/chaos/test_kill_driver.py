"""Kill -9 the driver of a real `asyncrl run` (the process with the loop, the gateway and the store's
client) mid-run, after a checkpoint and at least one step past it, then `asyncrl run --resume`: the
resumed run finishes from that checkpoint with no rollout lost and none trained twice.

The driver's Ray (GCS, raylet, the actors) dies with it; what Ray leaves behind is killed before the
resume. The time to recover is the kill to the resumed run's first moment of serving (its Ray,
actors, gateway, the push of the checkpoint's weights and the claim of what the dead run left).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

STEPS = 12


def test_a_killed_driver_resumes_from_its_last_checkpoint_with_nothing_lost_or_trained_twice(start_run, books, figures):
    first = start_run("driver", f"loop.steps={STEPS}", "learner.checkpoint_every=2")
    first.wait_until(lambda: first.step() > first.committed() >= 2, "a learner step past a checkpoint")
    killed_at, step_at_kill = first.kill9(first.pid), first.step()
    first.process.wait()
    first.wait_until_gone("ray::RolloutWorker", "ray::LearnerActor")  # the actors die with their owner
    first.kill_session()  # Ray's agents linger a while
    committed = first.committed()
    assert not (first.run_dir / "summary.json").exists()  # it never reached its end

    second = start_run("driver", resume=True)
    assert second.finish() == 0, second.tail()
    summary = second.summary()
    assert summary["version"] == STEPS and summary["engine_versions"] == [STEPS]
    resumed = summary["resumed"]
    assert resumed["version"] == committed and resumed["checkpoint"].endswith(f"step-{committed:06d}")
    assert resumed["recovered"] > 0  # what the dead run had not committed was claimed again
    accounts = books(second.run_dir)

    figures("kill_driver", {
        "kill_to_serving_s": round(resumed["serving_at"] - killed_at, 2),
        "resume_start_s": round(resumed["restart_s"], 2),
        "step_at_kill": step_at_kill, "resumed_at_step": committed, "reclaimed": resumed["recovered"],
        "steps": STEPS, **accounts,
    })  # fmt: skip
