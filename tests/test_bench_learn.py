"""`asyncrl bench learn` end to end on a tiny policy: a short SFT warm start shared by every side, then
asyncrl (Ray actors, gateway, store), the plain one-process loop and TRL's GRPOTrainer, each for a few
optimizer steps; the JSON holds each side's curve and figures, they agree with each other, and the plot is written.

Every phase ends by count (SFT steps, each side's loop.steps), not by the clock: what a side did in so many
seconds depends on the machine, so verdicts about it would too. The time budgets only bound a hang."""

from __future__ import annotations

import json
import os

import pytest
from loop_helpers import TINY

from asyncrl.bench import BENCHMARKS
from asyncrl.bench.learn import OVERRIDES, PRESET, LearnBenchOptions, _compare, _side
from asyncrl.configs.loader import load_config

pytest.importorskip("trl")

SFT_STEPS, RL_STEPS = 300, 4
HANG_GUARD_S = 600
"""Every time budget: reached only by a phase that stopped making progress."""


def _rate_agrees(record: dict, count: int) -> bool:
    """`samples_per_s` is `count` over the unrounded wall, to 0.01; the record's `wall_s` is rounded to 0.1 s."""
    wall_s = record["wall_s"]
    fastest = count / (wall_s - 0.05) if wall_s > 0.05 else float("inf")
    return count / (wall_s + 0.05) - 0.005 <= record["samples_per_s"] <= fastest + 0.005


@pytest.mark.slow  # an SFT warm start, then three short training runs
def test_every_side_learns_from_the_same_checkpoint(ray_session, tmp_path):
    from asyncrl.bench.learn import run

    # One-digit sums, so that SFT_STEPS of SFT leave reward signal for the sides' optimizer steps (about half the
    # held-out answers right): a group whose rewards are all equal takes no step, and only steps end a side. The
    # preset's learning rate, not TINY's 1e-2, after which one step could leave no answer right and so no signal.
    config = load_config(PRESET, [*OVERRIDES, *TINY, "loop.sft_first=true", f"sft.max_steps={SFT_STEPS}",
                                  f"sft.time_budget_s={HANG_GUARD_S}", "sft.eval_every=1000", f"loop.steps={RL_STEPS}", "learner.lr=1e-4",
                                  "loop.eval_every=2", "tasks.arithmetic.max_digits=1", "tasks.arithmetic.word_problem_fraction=0",
                                  "eval.num_problems=8", f"runs_dir={tmp_path}"])  # fmt: skip
    path = tmp_path / "bench.json"
    options = LearnBenchOptions(budget_s=HANG_GUARD_S, sides=["async", "trl", "plain"], trl_eval_every_s=HANG_GUARD_S, engine_alone_s=2)
    results = run(config, str(path), options)

    assert json.loads(path.read_text()) == results and (tmp_path / "bench.png").stat().st_size > 0
    assert results["setup"]["sft"]["steps"] == SFT_STEPS and results["notes"] == []
    sides = results["sides"]
    assert set(sides) == {"async", "plain", "trl"}
    for name, side in sides.items():
        curve = side["curve"]
        assert curve[0]["s"] == 0.0 and curve[0]["samples"] == 0 and len(curve) >= 2, name
        assert [p["s"] for p in curve] == sorted(p["s"] for p in curve) and curve[-1]["samples"] == side["samples_trained"]
        # Each side trains to its end, loop.steps optimizer steps, and no further.
        assert side["optimizer_steps"] == RL_STEPS and side["samples_trained"] > 0, name
        assert _rate_agrees(side, side["samples_trained"]), (name, side)
        assert all(seconds > 0 for seconds in side["cpu_s"].values()), name
    # Same engine, same checkpoint, same held-out problems, greedy: the same starting score.
    assert sides["async"]["accuracy_start"] == sides["plain"]["accuracy_start"]
    assert sides["trl"]["torch_threads"] == (os.cpu_count() or 1)  # the whole machine, after the engine alone took one
    assert sides["trl"]["samples_trained"] == sides["trl"]["optimizer_steps"] * config.learner.group_size * config.learner.batch_groups
    assert 0 < sides["async"]["engine_busy_frac"][f"{config.name}-async-rollout-0"] <= 1
    alone = results["engine_alone"]
    assert alone["completions"] > 0 and _rate_agrees(alone, alone["completions"]), alone
    # Measured before the sides and again after them, and pooled.
    assert len(alone["runs"]) == 2 and alone["completions"] == sum(run["completions"] for run in alone["runs"])
    # The ratios are of the rates as recorded, to three places.
    for side in sides.values():
        assert side["fraction_of_engine_alone"] == round(side["samples_per_s"] / alone["samples_per_s"], 3)
    assert results["async_over_trl_samples_per_s"] == round(sides["async"]["samples_per_s"] / sides["trl"]["samples_per_s"], 3)


def test_time_to_trl_accuracy_reads_the_mean_of_its_last_three_evaluations():
    trl = _side([(0.0, 0, 0.2), (10.0, 100, 0.3), (20.0, 200, 0.5), (30.0, 300, 0.4), (40.0, 400, 0.3)], trained=400, wall_s=40.0,
                optimizer_steps=4, cpu_s={})  # fmt: skip
    ours = _side([(0.0, 0, 0.2), (8.0, 120, 0.35), (16.0, 240, 0.41)], trained=240, wall_s=16.0, optimizer_steps=6, cpu_s={})
    compared = _compare({"async": ours, "trl": trl})
    assert compared["trl_end_accuracy"] == 0.4 and compared["async_s_to_trl_end"] == 16.0
    assert compared["async_time_frac_of_trl"] == 0.4 and compared["async_over_trl_samples_per_s"] == 1.5
    assert (ours["s_to_plus_10"], ours["s_to_plus_20"], trl["s_to_plus_10"], trl["s_to_plus_20"]) == (8.0, 16.0, 10.0, 20.0)
    assert _compare({"async": ours}) == {}
    # At each of TRL's evaluation times, async's last evaluated accuracy by then.
    assert [(p["s"], p["trl"], p["async"]) for p in compared["at_trl_evaluations"]] == [
        (10.0, 0.3, 0.35), (20.0, 0.5, 0.41), (30.0, 0.4, 0.41), (40.0, 0.3, 0.41)
    ]  # fmt: skip
    assert compared["async_ahead_at_every_trl_evaluation"] is False  # 0.41 < 0.5 at 20 s
    later = _side([(0.0, 0, 0.2), (12.0, 150, 0.6)], trained=150, wall_s=12.0, optimizer_steps=3, cpu_s={})
    assert _compare({"async": later, "trl": trl})["async_ahead_at_every_trl_evaluation"] is False  # still at its start at 10 s


def test_registered_with_its_settings():
    config, options = BENCHMARKS["learn"].resolve(None, ["bench.budget_s=60", "bench.sides=[plain]"])
    assert options == LearnBenchOptions(budget_s=60, sides=["plain"]) and config.loop.eval_every == 25
    with pytest.raises(Exception, match=r"bench\.sides"):
        BENCHMARKS["learn"].resolve(None, ["bench.sides=[nope]"])
