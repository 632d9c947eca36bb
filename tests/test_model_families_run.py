"""`asyncrl run` on a checkpoint directory of a real family (tests/families.py): the run starts from it,
its engines sample through the native or the generic path, and the learner takes optimizer steps whose
log-probs match the engines' (the family's forward is the same on both sides)."""

from __future__ import annotations

import json

import pytest
from families import save_family_checkpoint

from asyncrl.cli import main
from asyncrl.sched.rundir import RunDir

RUN = [
    "loop.sft_first=false", "rollout.cpus_per_worker=0.5", "rollout.max_num_seqs=16",
    "learner.num_cpus=0.5", "learner.group_size=4", "learner.batch_groups=2", "learner.lr=1e-2", "learner.checkpoint_every=2",
    "loop.max_inflight=16", "loop.mode=sync", "loop.steps=3", "loop.eval_every=1000", "eval.num_problems=4", "eval.max_tokens=4",
    "logging.wandb=disabled", "logging.progress=false", 'tasks.mix={echo: {env: "replay_envs:EchoEnv"}}',
]  # fmt: skip
QUICK = ("llama", "gpt2")
"""One native and one generic family in the default tier; the others are slow-marked."""


@pytest.mark.parametrize(
    "family",
    [f if f in QUICK else pytest.param(f, marks=pytest.mark.slow) for f in ("llama", "gpt2", "qwen2", "glm4_moe", "deepseek_v3", "phi")],
)
def test_asyncrl_run_trains_a_family_checkpoint(tmp_path, family):
    checkpoint = save_family_checkpoint(family, tmp_path / "checkpoint")
    code = main(["run", "quickstart", f"runs_dir={tmp_path}", f"name={family}", f"policy.path={checkpoint}", *RUN])
    assert code == 0
    run_dir = RunDir(tmp_path / family).path
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if m.get("stepped")]
    assert summary["balanced"] and summary["version"] >= 2
    assert len(trained) >= 2
    # The learner's log-probs of the sampled tokens are the engines' (same family, same weights, float32).
    assert max(m["abs_logp_diff"] for m in trained) < 1e-3
