"""`asyncrl bench replay` made tiny: the synthetic run is a run replay can read, and the JSON has the figures."""

from __future__ import annotations

import json

from asyncrl.bench.replay import ReplayBenchOptions, run
from asyncrl.cli import main
from asyncrl.configs.loader import load_config
from asyncrl.replay.run import RunView, Selection


def test_a_tiny_replay_bench_writes_its_figures(tmp_path, capsys) -> None:
    path = tmp_path / "replay.json"
    assert main(["bench", "replay", "bench.trajectories=50", "bench.score_trajectories=20", "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    assert results == json.loads(capsys.readouterr().out)
    assert results["trajectories"] == 50
    assert 0 < results["open_s"] <= results["open_select_s"]
    rescore = results["rescore"]
    assert rescore["trajectories"] == 20 and rescore["samples"] == 20 and rescore["series"] == ["nearest", "final"]
    assert 0 < rescore["sampled_tokens"] < rescore["tokens"]
    assert rescore["sampled_tokens_per_s"] > 0 and results["forward_only"]["tokens_per_s"] > 0


def test_the_synthetic_run_has_groups_turns_and_a_real_checkpoint(tmp_path) -> None:
    config = load_config("quickstart", ["learner.group_size=4"])
    run(config, None, ReplayBenchOptions(trajectories=12, score_trajectories=12, keep=str(tmp_path)))
    with RunView.open(tmp_path / "replay-bench") as view:
        trajectories = view.select(Selection())
        assert [ref.label for ref in view.checkpoints()] == ["start", "v1"]
        assert len(trajectories) == 12 and len({t.group_id for t in trajectories}) == 3
        assert all(t.status == "ok" and t.reward in (0.0, 1.0) for t in trajectories)
        for t in trajectories:
            # An agentic rollout's second prompt extends its first turn: one sample, the tool output masked.
            assert all(later.prompt_token_ids[: len(earlier.prompt_token_ids)] == earlier.prompt_token_ids
                       for earlier, later in zip(t.turns, t.turns[1:], strict=False))  # fmt: skip
            assert len({v for turn in t.turns for v in turn.versions}) == 1
