"""`asyncrl bench objectives` end to end on the tiny policy: one short SFT warm start, then an `asyncrl run` per
objective (and the dynamic-sampling row), each in a process of its own for the same number of steps; the JSON
and the markdown table hold one row each. Every phase ends by count, not by the clock."""

from __future__ import annotations

import json

import pytest
from loop_helpers import TINY

from asyncrl.bench import BENCHMARKS
from asyncrl.bench.objectives import OVERRIDES, PRESET, ObjectivesBenchOptions, run
from asyncrl.configs.loader import load_config

SFT_STEPS = 300  # as tests/test_bench_learn.py, whose sides need the same signal
HANG_GUARD_S = 600
"""Every time budget: reached only by a phase that stopped making progress."""


@pytest.mark.slow  # an SFT warm start, then two short runs, each in a fresh process with its own Ray
def test_every_objective_row_trains_the_same_steps_from_one_checkpoint(tmp_path):
    # One-digit sums without word problems, after SFT_STEPS of SFT about half the held-out answers are right, so
    # groups have signal and step (40 steps left one CI machine at 0%: no group had signal and the row never
    # stepped). The preset's learning rate, not TINY's 1e-2, after which one step could leave no answer right.
    config = load_config(PRESET, [*OVERRIDES, *TINY, f"sft.max_steps={SFT_STEPS}", "sft.eval_every=1000",
                                  f"sft.time_budget_s={HANG_GUARD_S}", f"loop.wall_budget_s={HANG_GUARD_S}", "learner.lr=1e-4",
                                  "tasks.arithmetic.max_digits=1", "tasks.arithmetic.word_problem_fraction=0",
                                  "eval.num_problems=8", f"runs_dir={tmp_path}"])  # fmt: skip
    path = tmp_path / "objectives.json"
    result = run(config, str(path), ObjectivesBenchOptions(objectives=["ppo"], steps=2, dynamic_sampling=True))
    assert json.loads(path.read_text()) == result
    rows = result["objectives"]
    assert [row["objective"] for row in rows] == ["ppo", "ppo + dynamic sampling"]
    assert all(row["steps"] == 2 and row["eval_before"] is not None and row["eval_after"] is not None for row in rows), rows
    assert rows[0]["dropped_no_signal"] == 0  # only the dynamic-sampling row drops groups
    table = path.with_suffix(".md").read_text()
    assert table.splitlines()[0].startswith("| objective |") and "| ppo + dynamic sampling |" in table


def test_an_unknown_objective_is_refused_before_anything_runs(tmp_path):
    config = load_config(PRESET, [*TINY, f"runs_dir={tmp_path}", "policy.path=/nonexistent"])
    with pytest.raises(ValueError, match=r"bench\.objectives: unknown \['nope'\]"):
        run(config, None, ObjectivesBenchOptions(objectives=["nope"]))
    assert "objectives" in BENCHMARKS
