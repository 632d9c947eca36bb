"""scripts/make_checkpoint.py: a random checkpoint of a real family and shape that asyncrl loads as its policy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from asyncrl.policy.checkpoint import load_policy

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_checkpoint.py"


def test_the_checkpoint_loads_as_the_policy_with_a_vocabulary_wider_than_its_tokenizer(tmp_path):
    shape = ["--vocab-size", "1000", "--hidden-size", "64", "--layers", "1", "--head-dim", "32"]
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "ckpt"), *shape], capture_output=True, text=True, check=True)
    assert "qwen3" in done.stdout and "vocabulary 1000" in done.stdout
    model, tokenizer, _ = load_policy(tmp_path / "ckpt", "auto", None)
    assert model.config.model_type == "qwen3" and model.config.vocab_size == 1000 > len(tokenizer)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 1 and tokenizer.chat_template


def test_a_vocabulary_below_the_tokenizer_is_refused(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "ckpt"), "--vocab-size", "10"], capture_output=True, text=True)
    assert done.returncode == 2 and "--vocab-size 10 is below the tokenizer's" in done.stderr
    assert not (tmp_path / "ckpt").exists()
