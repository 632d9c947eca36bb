"""`asyncrl bench learn` end to end on a tiny policy: a short SFT warm start shared by every side, then
asyncrl (Ray actors, gateway, store), the plain one-process loop and TRL's GRPOTrainer, each for a few
seconds; the JSON holds each side's curve and figures, they agree with each other, and the plot is written."""

from __future__ import annotations

import json
import os

import pytest
from loop_helpers import TINY

from asyncrl.bench import BENCHMARKS
from asyncrl.bench.learn import OVERRIDES, PRESET, LearnBenchOptions, _compare, _side
from asyncrl.configs.loader import load_config

pytest.importorskip("trl")


@pytest.mark.slow  # an SFT warm start, then three short training runs
def test_every_side_learns_from_the_same_checkpoint(ray_session, tmp_path):
    from asyncrl.bench.learn import run

    # One-digit sums, so that a few seconds of SFT leave some reward signal (the bench holds without it too).
    config = load_config(PRESET, [*OVERRIDES, *TINY, "loop.sft_first=true", "sft.time_budget_s=3", "sft.eval_every=1000",
                                  "loop.eval_every=2", "tasks.arithmetic.max_digits=1", "tasks.arithmetic.word_problem_fraction=0",
                                  "eval.num_problems=8", f"runs_dir={tmp_path}"])  # fmt: skip
    path = tmp_path / "bench.json"
    results = run(config, str(path), LearnBenchOptions(budget_s=4, sides=["async", "trl", "plain"], trl_eval_every_s=2, engine_alone_s=2))

    assert json.loads(path.read_text()) == results and (tmp_path / "bench.png").stat().st_size > 0
    assert results["setup"]["sft"]["steps"] > 0 and results["notes"] == []
    sides = results["sides"]
    assert set(sides) == {"async", "plain", "trl"}
    for name, side in sides.items():
        curve = side["curve"]
        assert curve[0]["s"] == 0.0 and curve[0]["samples"] == 0 and len(curve) >= 2, name
        assert [p["s"] for p in curve] == sorted(p["s"] for p in curve) and curve[-1]["samples"] == side["samples_trained"]
        # asyncrl's budget (loop.wall_budget_s) also covers its first evaluation; the others' start after theirs.
        assert side["wall_s"] >= (4 if name != "async" else 1) and side["samples_per_s"] == pytest.approx(
            side["samples_trained"] / side["wall_s"], rel=0.02
        )
        assert all(seconds > 0 for seconds in side["cpu_s"].values()), name
    # Same engine, same checkpoint, same held-out problems, greedy: the same starting score.
    assert sides["async"]["accuracy_start"] == sides["plain"]["accuracy_start"]
    assert sides["trl"]["torch_threads"] == (os.cpu_count() or 1)  # the whole machine, after the engine alone took one
    assert sides["trl"]["samples_trained"] == sides["trl"]["optimizer_steps"] * config.learner.group_size * config.learner.batch_groups
    assert 0 < sides["async"]["engine_busy_frac"][f"{config.name}-async-rollout-0"] <= 1
    alone = results["engine_alone"]
    assert alone["completions"] > 0 and alone["samples_per_s"] == pytest.approx(alone["completions"] / alone["wall_s"], rel=0.05)
    # Measured before the sides and again after them, and pooled.
    assert len(alone["runs"]) == 2 and alone["completions"] == sum(run["completions"] for run in alone["runs"])
    for side in sides.values():
        assert side["fraction_of_engine_alone"] == pytest.approx(side["samples_per_s"] / alone["samples_per_s"], rel=0.01)
    assert results["async_over_trl_samples_per_s"] == pytest.approx(
        sides["async"]["samples_per_s"] / sides["trl"]["samples_per_s"], rel=0.01
    )


def test_time_to_trl_accuracy_reads_the_mean_of_its_last_three_evaluations():
    trl = _side([(0.0, 0, 0.2), (10.0, 100, 0.3), (20.0, 200, 0.5), (30.0, 300, 0.4), (40.0, 400, 0.3)], trained=400, wall_s=40.0,
                optimizer_steps=4, cpu_s={})  # fmt: skip
    ours = _side([(0.0, 0, 0.2), (8.0, 120, 0.35), (16.0, 240, 0.41)], trained=240, wall_s=16.0, optimizer_steps=6, cpu_s={})
    compared = _compare({"async": ours, "trl": trl})
    assert compared["trl_end_accuracy"] == 0.4 and compared["async_s_to_trl_end"] == 16.0
    assert compared["async_time_frac_of_trl"] == 0.4 and compared["async_over_trl_samples_per_s"] == 1.5
    assert (ours["s_to_plus_10"], ours["s_to_plus_20"], trl["s_to_plus_10"], trl["s_to_plus_20"]) == (8.0, 16.0, 10.0, 20.0)
    assert _compare({"async": ours}) == {}


def test_registered_with_its_settings():
    config, options = BENCHMARKS["learn"].resolve(None, ["bench.budget_s=60", "bench.sides=[plain]"])
    assert options == LearnBenchOptions(budget_s=60, sides=["plain"]) and config.loop.eval_every == 25
    with pytest.raises(Exception, match=r"bench\.sides"):
        BENCHMARKS["learn"].resolve(None, ["bench.sides=[nope]"])
