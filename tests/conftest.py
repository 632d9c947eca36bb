"""Shared fixtures: tiny random policies small enough that a test builds and runs one in milliseconds."""

from __future__ import annotations

import os

import pytest
import torch

from asyncrl.configs.schema import TinyModelConfig
from asyncrl.policy.tiny import tiny_model_config

SMALL_SHAPE = dict(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
    experts_per_token=2, first_dense_layers=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=8, index_heads=2, index_head_dim=16, max_position_embeddings=128,
)  # fmt: skip


def make_tiny_model(arch: str = "glm_moe_dsa", *, seed: int = 0, eos_token_id: int | None = 1, config_overrides=None, **shape):
    """A tiny transformers causal LM whose weights are drawn at unit scale (normal / sqrt(fan_in)).

    transformers' own init (std 0.02) makes every distribution nearly uniform, which would let
    wrong attention or routing pass a numerical comparison; unit-scale weights make them matter.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_model_config(TinyModelConfig(arch=arch, **{**SMALL_SHAPE, **shape}), eos_token_id=eos_token_id)
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return unit_scale_(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())


def unit_scale_(model):
    """Redraw the model's weights in place: matrices normal / sqrt(fan_in), norm scales around 1, the rest small."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5)
            elif ("norm" in name or ".ln_" in name) and name.endswith("weight"):
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="session")
def glm_model():
    """A tiny GLM-5-family (`glm_moe_dsa`) policy with EOS = 1."""
    return make_tiny_model("glm_moe_dsa")


@pytest.fixture(scope="session")
def qwen3_model():
    """A tiny dense `qwen3` policy with EOS = 1."""
    return make_tiny_model("qwen3")


def load_from_object_store(workers: list, learner, version: int) -> list[int]:
    """The object-store push, as `RayWorkers.push` makes it: the learner's weights as one ObjectRef that
    every RolloutWorker loads; the version each then serves."""
    import ray

    weights = learner.state.remote()
    return ray.get([worker.load_weights.remote(weights, version) for worker in workers])


def run_to_completion(engine, requests: list[tuple[list[int], object]], session_id: str | None = None) -> list:
    """Submit (prompt, sampling) pairs to an engine, step it synchronously until all finish, return results in order."""
    ids = [engine.add_request(prompt, sampling, session_id=session_id) for prompt, sampling in requests]
    done = {}
    while engine.has_unfinished():
        done.update((result.request_id, result) for result in engine.step())
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray for one test module (two logical CPUs); skips where Ray is not installed."""
    ray = pytest.importorskip("ray")
    from asyncrl.rollout.worker import RAY_SYSTEM_CONFIG

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=RAY_SYSTEM_CONFIG)
    yield
    ray.shutdown()


@pytest.fixture
def one_torch_thread():
    """Torch on one thread for the test: learner and scorer forwards compared to 1e-4 and run beside
    other processes on 2 cores (more threads only contend)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


REDIS_URL = os.environ.get("ASYNCRL_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_or_skip():
    """A client of the real Redis server the tests use; the test is skipped without one, and fails under CI (the
    test script starts one there)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as error:
        if os.environ.get("CI"):
            pytest.fail(f"Redis unreachable at {REDIS_URL}: {error}")
        pytest.skip(f"Redis unreachable at {REDIS_URL}: {error}")
    return client
