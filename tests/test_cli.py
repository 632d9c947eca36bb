"""The CLI as users call it: `asyncrl generate` on a saved checkpoint."""

from __future__ import annotations

import json

import pytest

from asyncrl.cli import main
from asyncrl.configs.schema import PolicyConfig, TinyModelConfig
from asyncrl.policy.checkpoint import build_policy, save_policy


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    shape = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64)
    model, tokenizer, mtp = build_policy(PolicyConfig(tiny=shape), seed=0)
    return str(save_policy(tmp_path_factory.mktemp("ckpt"), model, tokenizer, mtp))


def test_generate_json_lines_align_tokens_logprobs_versions(checkpoint, capsys):
    assert main(["generate", checkpoint, "--prompt", "1+2=", "-n", "2", "--seed", "3", "--max-tokens", "5", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["sample"] for line in lines] == [0, 1]
    for line in lines:
        assert 1 <= len(line["token_ids"]) <= 5
        assert len(line["token_ids"]) == len(line["logprobs"]) == len(line["versions"])
        assert all(lp <= 0.0 for lp in line["logprobs"])
        assert line["finish_reason"] in ("stop", "length")
        assert line["prompt_token_ids"][-1] == 4  # the chat template ends with <|assistant|>


def test_generate_is_reproducible_with_a_seed(checkpoint, capsys):
    args = ["generate", checkpoint, "--raw", "7+8=", "--seed", "11", "--max-tokens", "6", "--json"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first


def test_generate_bad_token_id_is_a_clear_error(checkpoint, capsys):
    assert main(["generate", checkpoint, "--token-ids", "5,999"]) == 2
    assert "token id 999 is outside the vocabulary" in capsys.readouterr().err


def test_sft_command_end_to_end(tmp_path, capsys):
    tiny = ["policy.tiny.hidden_size=32", "policy.tiny.num_layers=2", "policy.tiny.num_heads=2", "policy.tiny.max_position_embeddings=256"]
    args = ["sft", "quickstart", f"runs_dir={tmp_path}", "sft.max_steps=2", "sft.batch_size=4", "eval.num_problems=4",
            "logging.progress=false", "logging.wandb=disabled", *tiny]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy:" in out and "after 2 steps" in out
    checkpoint = tmp_path / "quickstart" / "sft" / "checkpoint"
    assert (checkpoint / "config.json").exists() and (tmp_path / "quickstart" / "sft" / "metrics.jsonl").exists()


def test_token_prints_the_tokens_derived_from_the_served_runs_secret(tmp_path, capsys):
    from asyncrl.gateway.auth import Credentials
    from asyncrl.jobs.serve import SECRET_FILE, _secret

    overrides = [f"runs_dir={tmp_path}", "name=demo"]
    assert main(["token", "quickstart", *overrides]) == 2  # nothing served yet: no secret to derive from
    assert "asyncrl serve" in capsys.readouterr().err
    expected = Credentials.from_secret(_secret(tmp_path / "demo"))  # what `asyncrl serve` keeps in the run directory
    assert (tmp_path / "demo" / SECRET_FILE).stat().st_mode & 0o077 == 0
    for args, token in ((["quickstart", *overrides], expected.run_token), ([str(tmp_path / "demo"), "--engine"], expected.engine_token)):
        assert main(["token", *args]) == 0
        assert capsys.readouterr().out == token + "\n"
