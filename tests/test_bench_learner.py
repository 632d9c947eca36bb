"""`asyncrl bench learner`: one rank, two replicated and two sharded all run the real learner actor, and the JSON has every
figure."""

from __future__ import annotations

import json

import pytest

from asyncrl.cli import main

pytestmark = pytest.mark.slow  # a Ray start and five learner processes


def test_bench_learner_reports_both_rank_counts_and_the_push(tmp_path):
    path = tmp_path / "learner.json"
    overrides = ["policy.tiny.arch=qwen3", "policy.tiny.hidden_size=32", "policy.tiny.num_layers=2", "policy.tiny.num_heads=2",
                 "learner.batch_groups=2", "learner.group_size=4", "bench.steps=1", "bench.repeats=1", "bench.reply_tokens=8"]  # fmt: skip
    assert main(["bench", "learner", *overrides, "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    sides = result["sides"]
    assert result["samples_per_step"] == 8 and list(sides) == ["1", "2", "2-fsdp"]
    for name, side in sides.items():
        ranks = int(name.split("-")[0])
        assert side["samples_per_s"] > 0 and len(side["peak_rss_mb"]) == ranks and all(mb > 50 for mb in side["peak_rss_mb"])
        assert len(side["held_mb"]) == ranks
    # Replicated ranks each hold the whole weights and moments; FSDP's hold about half each.
    whole = sides["1"]["held_mb"][0]
    assert sides["2"]["held_mb"] == [whole, whole] and all(0.45 * whole < mb < 0.55 * whole for mb in sides["2-fsdp"]["held_mb"])
    assert result["dp_speedup"] == pytest.approx(sides["2"]["samples_per_s"] / sides["1"]["samples_per_s"])
    assert result["fsdp_speedup"] == pytest.approx(sides["2-fsdp"]["samples_per_s"] / sides["1"]["samples_per_s"])
    push = result["push"]
    assert push["bytes"] > 0 and push["seconds"] > 0 and push["copy_bandwidth_gb_s"] > 0
    assert push["push_over_copy_limit"] == pytest.approx(push["seconds"] / (push["bytes"] / (push["copy_bandwidth_gb_s"] * 1e9)))
