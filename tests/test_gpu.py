"""The CUDA paths, wherever a GPU is present (marker `gpu`; skipped on CPU machines): the learner on the GPU
takes the CPU learner's step, the embedded engine on the GPU samples with transformers' log-probs, and
`asyncrl run` trains with both on GPUs. scripts/gpu_smoke.sh runs these on a lent GPU machine. The run test
also runs on the CPU (marker `slow`), so its set-up is checked where no GPU is."""

from __future__ import annotations

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_the_learner_on_cuda_takes_the_cpu_learners_step():
    from test_learner_dp import batch, config

    from asyncrl.learner.rl import RLLearner

    cpu = RLLearner.from_config(config(1).model_copy(update={"learner": config(1).learner.model_copy(update={"device": "cpu"})}))
    gpu = RLLearner.from_config(config(1).model_copy(update={"learner": config(1).learner.model_copy(update={"device": "cuda"})}))
    assert gpu.device.type == "cuda"
    one, two = cpu.train_step(batch()), gpu.train_step(batch())
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-3)
    gap = max(
        float((a - b.cpu()).abs().max()) for a, b in zip(cpu.model.state_dict().values(), gpu.model.state_dict().values(), strict=True)
    )
    assert gap < 1e-4


@pytest.mark.gpu
@needs_cuda
def test_the_embedded_engine_on_cuda_matches_transformers():
    from conftest import run_to_completion
    from families import tiny_family_model
    from test_engine_numerics import PROMPTS, assert_matches_hf

    from asyncrl.configs.schema import EmbeddedRolloutConfig
    from asyncrl.records import SamplingParams
    from asyncrl.rollout import EmbeddedEngine

    for family in ("llama", "gpt2"):
        model = tiny_family_model(family)
        engine = EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=4, device="cuda"))
        assert engine.device.type == "cuda"
        results = run_to_completion(engine, [(p, SamplingParams(temperature=1.0, max_tokens=8, seed=2)) for p in PROMPTS])
        assert_matches_hf(model, results)
        engine.shutdown()


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda]), pytest.param("cpu", marks=pytest.mark.slow)])
def test_asyncrl_run_with_learner_and_engine_on_the_device(tmp_path, device):
    import json

    pytest.importorskip("ray", reason="a machine without Ray (the lent GPU machine: scripts/gpu_smoke.sh --offline)")
    pytest.importorskip("fastapi", reason="a machine without the gateway's dependencies")

    from loop_helpers import TINY

    from asyncrl.cli import main

    # EchoEnv: a task whose groups a random tiny policy tells apart, so the loop has advantages to step on.
    overrides = [*TINY, f"runs_dir={tmp_path}", "name=gpu", "loop.mode=sync", "loop.steps=3", "loop.eval_every=1000", "eval.num_problems=4",
                 'tasks.mix={echo: {env: "replay_envs:EchoEnv"}}', f"learner.device={device}", f"rollout.device={device}"]  # fmt: skip
    if device == "cuda" and torch.cuda.device_count() < 2:  # each asks for a whole GPU by default; on one, they share it by asking
        overrides += ["learner.gpus_per_rank=0.5", "rollout.gpus_per_worker=0.5"]
    assert main(["run", "quickstart", *overrides]) == 0
    summary = json.loads((tmp_path / "gpu" / "summary.json").read_text())
    assert summary["balanced"] and summary["version"] == 3
