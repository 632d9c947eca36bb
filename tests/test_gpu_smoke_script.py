"""scripts/gpu_smoke.py runs its checks on the CPU too (`--device cpu`), so the script a lent GPU machine runs
is exercised here; scripts/gpu_smoke.sh refuses what it does not know."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # every check once, at its smallest: ~15 s


def test_the_smoke_checks_run_on_the_cpu_and_write_every_figure(tmp_path):
    command = [
        sys.executable,
        "scripts/gpu_smoke.py",
        "--device",
        "cpu",
        "--quick",
        "--size",
        "128",
        "--run-seconds",
        "0",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_smoke.json").read_text())
    assert results["engine_llama_GqaModel_max_logprob_gap"] < 1e-4 and results["engine_gpt2_TransformersModel_max_logprob_gap"] < 1e-4
    assert len(results["engine_native_tokens_per_s"]) == 2 and min(results["engine_generic_tokens_per_s"]) > 0
    assert results["learner_step_max_weight_gap"] == 0.0  # the same device twice
    assert results["learner_plain_samples_per_s"] > 0 and results["learner_checkpointed_samples_per_s"] > 0
    assert results["learner_push_mb"] > 0 and results["learner_push_s"] > 0 and results["learner_push_over_copy_limit"] > 0
    assert results["broadcast_backend"] == "gloo" and results["broadcast_bit_exact"] is True and results["broadcast_s"] > 0
    assert results["learner_wide_vocab_chunked_samples_per_s"] > 0 and results["learner_wide_vocab_one_buffer_samples_per_s"] > 0
    assert results["asyncrl_run"].startswith("skipped")


def test_the_wrapper_refuses_an_unknown_mode():
    done = subprocess.run(["bash", "scripts/gpu_smoke.sh", "--nope"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage: scripts/gpu_smoke.sh" in done.stderr
