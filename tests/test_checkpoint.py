"""Policy checkpoints: bit-exact round trips, the vLLM MTP layout, and plain transformers loading."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.configs.schema import MTPConfig, PolicyConfig, TinyModelConfig
from asyncrl.policy.checkpoint import build_policy, load_policy, save_policy
from asyncrl.policy.mtp import mtp_logits, policy_hidden_and_logits

SMALL = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, moe_intermediate_size=16)


def small_config(arch: str = "glm_moe_dsa", **changes) -> PolicyConfig:
    return PolicyConfig(tiny=TinyModelConfig(arch=arch, **SMALL), **changes)


def keys(path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def outputs(model, mtp, ids):
    with torch.no_grad():
        hidden, logits = policy_hidden_and_logits(model.eval(), ids)
        return [logits, *mtp_logits(model, mtp.eval(), hidden, ids, None, depth=2)]


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3"])
def test_round_trip_preserves_policy_and_mtp_outputs_bit_exactly(tmp_path, arch):
    model, tokenizer, mtp = build_policy(small_config(arch), seed=0)
    save_policy(tmp_path, model, tokenizer, mtp, extra_config={"asyncrl": {"stage": "sft"}})
    loaded, loaded_tokenizer, loaded_mtp = load_policy(tmp_path)
    ids = torch.randint(20, 100, (2, 9))
    for before, after in zip(outputs(model, mtp, ids), outputs(loaded, loaded_mtp, ids), strict=True):
        assert torch.equal(before, after)
    assert loaded_tokenizer.get_vocab() == tokenizer.get_vocab()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert config["asyncrl"] == {"stage": "sft"}


def test_mtp_keys_follow_the_vllm_layout(tmp_path):
    model, tokenizer, mtp = build_policy(small_config(), seed=0)
    save_policy(tmp_path, model, tokenizer, mtp)
    n = model.config.num_hidden_layers
    mtp_keys = keys(tmp_path / "mtp.safetensors")
    assert all(k.startswith(f"model.layers.{n}.") for k in mtp_keys)
    local = {k.removeprefix(f"model.layers.{n}.") for k in mtp_keys}
    own = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
    copies = {"embed_tokens.weight", "shared_head.head.weight"}
    assert own | copies <= local
    # The decoder block is named exactly like the policy's last (MoE) layer in model.safetensors,
    # experts one by one, which is what vLLM's DeepSeek/GLM MTP loaders map onto their mtp_block.
    last = {k.removeprefix(f"model.layers.{n - 1}.") for k in keys(tmp_path / "model.safetensors")
            if k.startswith(f"model.layers.{n - 1}.")}  # fmt: skip
    assert local - own - copies == last
    assert "mlp.experts.0.gate_proj.weight" in last
    assert not any(k.startswith(f"model.layers.{n}.") for k in keys(tmp_path / "model.safetensors"))


def test_transformers_loads_the_directory_offline_without_unexpected_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer, mtp = build_policy(small_config(), seed=0)
    save_policy(tmp_path, model, tokenizer, mtp)
    loaded, info = AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    ids = torch.randint(20, 100, (1, 7))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)
    assert AutoTokenizer.from_pretrained(str(tmp_path)).eos_token_id == tokenizer.eos_token_id
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id


def test_dense_fallback_keeps_its_mtp_out_of_vllms_way(tmp_path):
    model, tokenizer, mtp = build_policy(small_config("qwen3"), seed=0)
    save_policy(tmp_path, model, tokenizer, mtp)
    assert not list(tmp_path.glob("*.safetensors"))[1:], "only model.safetensors at the top level"
    assert (tmp_path / "mtp" / "mtp.safetensors").exists()


def test_build_policy_fresh_loaded_and_without_mtp(tmp_path):
    model, tokenizer, mtp = build_policy(small_config(), seed=0)
    assert mtp is not None
    save_policy(tmp_path, model, tokenizer, mtp=None)
    assert "num_nextn_predict_layers" not in json.loads((tmp_path / "config.json").read_text())
    # A checkpoint without MTP gets a fresh MTP layer when MTP is enabled, none when disabled.
    _, _, fresh = build_policy(PolicyConfig(path=str(tmp_path)), seed=0)
    assert fresh is not None and fresh.layer_index == 2
    _, _, none = build_policy(PolicyConfig(path=str(tmp_path), mtp=MTPConfig(enabled=False)), seed=0)
    assert none is None
    # The same seed builds the same fresh policy.
    again, _, _ = build_policy(small_config(), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))
