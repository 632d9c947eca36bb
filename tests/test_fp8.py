"""FP8 weights in the embedded engine: the quantization error bound, the product, start-up refusals,
and re-quantization when the learner pushes new weights."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model, run_to_completion
from test_engine_numerics import hf_logprobs

from asyncrl.configs.schema import EmbeddedRolloutConfig, TinyModelConfig
from asyncrl.policy.tiny import build_tiny_model
from asyncrl.records import SamplingParams
from asyncrl.rollout import EmbeddedEngine
from asyncrl.rollout.fp8 import Fp8Error, Fp8Weight, linear, quantize, weight_bytes

E4M3_RELATIVE_STEP = 2.0**-4
"""Half the spacing of e4m3's 3-bit mantissa: the largest relative rounding error of a normal value."""
E4M3_SUBNORMAL_STEP = 2.0**-9
"""Spacing of e4m3's subnormals (in units of the row scale): the absolute error floor of small values."""
LOGPROB_GAP_BOUND = 0.25
"""Mean |FP8 engine log-prob - fp32 transformers log-prob| allowed on the tiny unit-scale test policy
(seen ~0.1: its random unit-scale weights make sharp logits that amplify rounding; the SFT policy
in `asyncrl bench engine` shows ~0.01)."""


def test_quantization_error_is_within_the_e4m3_bound():
    torch.manual_seed(0)
    w = torch.randn(40, 64) * torch.logspace(-3, 2, 40)[:, None]  # rows of very different scales
    q = quantize("w", w)
    assert q.qweight.dtype == torch.float8_e4m3fn and q.qweight.shape == (48, 64)  # rows padded to 16
    error = (q.dequantize(torch.float32) - w).abs()
    bound = E4M3_RELATIVE_STEP * w.abs() + E4M3_SUBNORMAL_STEP * q.scale[0, :40, None]
    assert (error <= bound * (1 + 1e-6)).all()
    # Each row's largest value maps onto e4m3's largest finite value: no clipping, full range.
    assert torch.allclose(q.dequantize(torch.float32).abs().amax(1), w.abs().amax(1), rtol=E4M3_RELATIVE_STEP)


def test_fp8_product_is_close_to_the_full_precision_one():
    torch.manual_seed(1)
    x, w, bias = torch.randn(5, 7, 128), torch.randn(100, 128) / 128**0.5, torch.randn(100)
    exact = torch.nn.functional.linear(x, w, bias)
    for got in (linear(x, quantize("w", w), bias), torch.nn.functional.linear(x, quantize("w", w).dequantize(x.dtype), bias)):
        assert got.shape == exact.shape
        assert ((got - exact).norm() / exact.norm()).item() < 0.06  # activations and weights both rounded


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3"])
def test_fp8_engine_logprobs_stay_close_to_the_learner(arch):
    model = make_tiny_model(arch)
    engine = EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=8, fp8=True))
    assert any(isinstance(v, Fp8Weight) for v in engine.model.weights["layers"][-1].values())
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=5)
    results = run_to_completion(engine, [(p, params) for p in ([5, 17, 33, 9, 64], list(range(20, 45)))])
    gaps = torch.cat([(torch.tensor(r.logprobs) - hf_logprobs(model, r.prompt_token_ids, r.token_ids)).abs() for r in results])
    assert 0 < gaps.mean().item() < LOGPROB_GAP_BOUND  # > 0: the weights really are quantized


def test_fp8_weights_take_about_half_of_bf16():
    model = build_tiny_model(TinyModelConfig(arch="qwen3"))
    fp8 = EmbeddedEngine(model, EmbeddedRolloutConfig(fp8=True))
    full = EmbeddedEngine(model, EmbeddedRolloutConfig())
    assert weight_bytes(fp8.model.weights) / weight_bytes(full.model.weights) <= 0.55


def test_a_model_that_cannot_be_quantized_is_refused_at_start_up():
    model = make_tiny_model("qwen3", hidden_size=24, intermediate_size=48)  # widths not multiples of 16
    with pytest.raises(Fp8Error, match=r"layers\.0\.qkv has input width 24, not a multiple of 16"):
        EmbeddedEngine(model, EmbeddedRolloutConfig(fp8=True))
    EmbeddedEngine(model, EmbeddedRolloutConfig())  # the same model runs in full precision


def test_a_weight_push_is_quantized_again():
    model, other = make_tiny_model("qwen3", seed=0), make_tiny_model("qwen3", seed=1)
    engine = EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=4, fp8=True))
    engine.update_weights(other.state_dict(), version=1)
    fresh = EmbeddedEngine(other, EmbeddedRolloutConfig(max_num_seqs=4, fp8=True))
    pushed = engine.model.weights["layers"][0]["qkv"]
    assert isinstance(pushed, Fp8Weight)
    assert torch.equal(pushed.qweight.view(torch.uint8), fresh.model.weights["layers"][0]["qkv"].qweight.view(torch.uint8))
    greedy = SamplingParams(temperature=0, max_tokens=8)
    assert run_to_completion(engine, [([3, 4, 5], greedy)])[0].token_ids == run_to_completion(fresh, [([3, 4, 5], greedy)])[0].token_ids


def test_fp8_with_mtp_drafting_keeps_greedy_output():
    from asyncrl.policy.mtp import build_mtp

    model = make_tiny_model("glm_moe_dsa", eos_token_id=None, config_overrides={"vocab_size": 8})
    mtp = build_mtp(model, seed=1).eval()
    greedy = SamplingParams(temperature=0, max_tokens=16)
    plain = run_to_completion(EmbeddedEngine(model, EmbeddedRolloutConfig(fp8=True)), [([1, 2, 3, 4], greedy)])[0]
    spec = EmbeddedEngine(model, EmbeddedRolloutConfig(fp8=True, mtp_drafting=True, mtp_draft_tokens=3), mtp=mtp)
    assert isinstance(spec.drafter.weights["eh_proj"], Fp8Weight)
    assert run_to_completion(spec, [([1, 2, 3, 4], greedy)])[0].token_ids == plain.token_ids
