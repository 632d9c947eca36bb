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


@pytest.mark.slow  # an SFT warm start, then two short runs, each in a fresh process with its own Ray
def test_every_objective_row_trains_the_same_steps_from_one_checkpoint(tmp_path):
    config = load_config(PRESET, [*OVERRIDES, *TINY, "sft.max_steps=40", "sft.eval_every=1000", "sft.time_budget_s=600",
                                  "loop.wall_budget_s=600", "tasks.arithmetic.max_digits=1", "eval.num_problems=8",
                                  f"runs_dir={tmp_path}"])  # fmt: skip
    path = tmp_path / "objectives.json"
    # One-digit sums: sampled at temperature 1, even this policy gets some right, so groups have signal and step.
    result = run(config, str(path), ObjectivesBenchOptions(objectives=["ppo"], steps=2, dynamic_sampling=True))
    assert json.loads(path.read_text()) == result
    rows = result["objectives"]
    assert [row["objective"] for row in rows] == ["ppo", "ppo + dynamic sampling"]
    assert all(row["steps"] == 2 and row["eval_before"] is not None and row["eval_after"] is not None for row in rows)
    assert rows[0]["dropped_no_signal"] == 0  # only the dynamic-sampling row drops groups
    table = path.with_suffix(".md").read_text()
    assert table.splitlines()[0].startswith("| objective |") and "| ppo + dynamic sampling |" in table


def test_an_unknown_objective_is_refused_before_anything_runs(tmp_path):
    config = load_config(PRESET, [*TINY, f"runs_dir={tmp_path}", "policy.path=/nonexistent"])
    with pytest.raises(ValueError, match=r"bench\.objectives: unknown \['nope'\]"):
        run(config, None, ObjectivesBenchOptions(objectives=["nope"]))
    assert "objectives" in BENCHMARKS
