"""`asyncrl bench async` on the command line: its preset and sizing under the user's overrides,
`bench.*` words as its own settings, and refusals that name the key (dry runs: nothing starts)."""

from __future__ import annotations

import yaml

from asyncrl.cli import EXIT_CONFIG_ERROR, build_parser, main


def dry_run(capsys, *words: str) -> dict:
    assert main(["bench", "async", *words, "--dry-run"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_the_bench_sizing_sits_between_the_preset_and_the_command(capsys):
    resolved = dry_run(capsys)
    assert resolved["name"] == "bench-async" and resolved["policy"]["tiny"]["arch"] == "qwen3"  # quickstart's policy
    assert resolved["loop"]["steps"] == 12 and resolved["learner"]["max_staleness"] == 4  # the bench's sizing
    assert resolved["bench"]["latency"]["median_s"] == 0.5

    resolved = dry_run(capsys, "loop.steps=3", "bench.latency.median_s=2", "bench.latency.when=before")
    assert resolved["loop"]["steps"] == 3  # the command's override wins
    latency = resolved["bench"]["latency"]
    assert (latency["median_s"], latency["when"], latency["sigma"]) == (2.0, "before", 1.0)


def test_bad_bench_settings_are_refused_by_name(capsys):
    assert main(["bench", "async", "bench.latency.median=1", "--dry-run"]) == EXIT_CONFIG_ERROR
    assert "bench.latency.median: unknown key" in capsys.readouterr().err
    assert main(["bench", "async", "bench.latency.tail_prob=2", "--dry-run"]) == EXIT_CONFIG_ERROR
    assert "bench.latency.tail_prob" in capsys.readouterr().err
    assert main(["bench", "engine", "bench.latency.median_s=1", "--dry-run"]) == EXIT_CONFIG_ERROR
    assert "bench.latency: unknown key" in capsys.readouterr().err  # the engine bench has settings, not these
    assert main(["bench", "gateway", "bench.latency.median_s=1", "--dry-run"]) == EXIT_CONFIG_ERROR
    assert "no bench.* settings" in capsys.readouterr().err


def test_help_lists_the_bench_settings():
    text = build_parser()._subparsers._group_actions[0].choices["bench"].format_help()
    assert "bench.latency.tail_alpha" in text and "async: config quickstart" in text
