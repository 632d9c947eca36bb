"""The native forward passes against transformers: engine log-probs equal a full HF forward (fp32)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model, run_to_completion

from asyncrl.configs.schema import EmbeddedRolloutConfig
from asyncrl.records import SamplingParams
from asyncrl.rollout import EmbeddedEngine

TOLERANCE = 1e-4
"""Max abs difference of per-token log-probs, engine vs transformers, both fp32 (seen: ~5e-6)."""


def hf_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of `completion` given `prompt` from one full forward of the transformers model."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def assert_matches_hf(model, results, temperature: float = 1.0) -> None:
    for result in results:
        expected = hf_logprobs(model, result.prompt_token_ids, result.token_ids, temperature)
        diff = (torch.tensor(result.logprobs) - expected).abs().max().item()
        assert diff < TOLERANCE, f"request {result.request_id}: max |logprob diff| {diff:.2e}"


def engine_for(model, **options) -> EmbeddedEngine:
    return EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=8, **options))


PROMPTS = [[5, 17, 33, 9, 64, 2, 71], [40, 41, 42], list(range(20, 45))]


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3"])
def test_sampled_logprobs_equal_full_hf_forward(arch, glm_model, qwen3_model):
    model = glm_model if arch == "glm_moe_dsa" else qwen3_model
    # Ragged prompts prefilled together, then decoded together: every path of the unified forward.
    params = SamplingParams(temperature=0.7, max_tokens=16, seed=3)
    results = run_to_completion(engine_for(model), [(p, params) for p in PROMPTS])
    assert all(len(r.token_ids) > 1 for r in results)
    assert_matches_hf(model, results, temperature=0.7)


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3"])
def test_greedy_follows_hf_argmax_with_raw_logprobs(arch, glm_model, qwen3_model):
    model = glm_model if arch == "glm_moe_dsa" else qwen3_model
    (result,) = run_to_completion(engine_for(model), [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12))])
    ids = torch.tensor([result.prompt_token_ids + result.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(result.prompt_token_ids) - 1 : -1]
    # The final token is checked too: either it was EOS or max_tokens was reached.
    assert result.token_ids == logits.argmax(-1).tolist()
    assert_matches_hf(model, [result])


def test_dsa_sparse_attention_and_shared_indexer_layers_match_hf():
    # index_topk 6 with 30+ token contexts: most queries attend to a strict subset chosen by the
    # indexer. Sixteen indexer heads make exact score ties (all heads' ReLU at 0) vanishingly rare,
    # so transformers' topk and the engine's stable sort pick the same positions. Layer 2 reuses
    # layer 1's selection ("shared").
    model = make_tiny_model(
        "glm_moe_dsa", num_layers=3, index_topk=6, index_heads=16, eos_token_id=None,
        config_overrides={"indexer_types": ["full", "full", "shared"]},
    )  # fmt: skip
    assert model.model.layers[2].self_attn.indexer is None
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=11)
    results = run_to_completion(engine_for(model), [(p, params) for p in PROMPTS])
    assert_matches_hf(model, results)


def test_many_experts_use_the_per_expert_path_and_match_hf():
    model = make_tiny_model("glm_moe_dsa", num_experts=40, experts_per_token=3, eos_token_id=None)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=5)
    results = run_to_completion(engine_for(model), [(p, params) for p in PROMPTS])
    assert_matches_hf(model, results)


def test_qwen3_grouped_query_attention_matches_hf():
    model = make_tiny_model("qwen3", num_heads=4, config_overrides={"num_key_value_heads": 2})
    assert model.model.layers[0].self_attn.k_proj.out_features == 2 * 8
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=2)
    results = run_to_completion(engine_for(model), [(p, params) for p in PROMPTS])
    assert_matches_hf(model, results)


def test_from_pretrained_loads_a_model_directory(tmp_path, qwen3_model):
    qwen3_model.save_pretrained(tmp_path)
    engine = EmbeddedEngine.from_pretrained(tmp_path, EmbeddedRolloutConfig(max_num_seqs=2))
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=1)
    assert_matches_hf(qwen3_model, run_to_completion(engine, [(PROMPTS[1], params)]))
