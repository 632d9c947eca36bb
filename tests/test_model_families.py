"""Any Hugging Face causal LM as the policy: tiny random checkpoints of real families (tests/families.py)
through the embedded engine, natively (llama, qwen2, mistral) or over transformers' own forward (the rest),
with log-probs equal to a full transformers forward; and what is refused, with the key and the problem."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import run_to_completion
from families import FAMILIES, NATIVE, save_family_checkpoint, tiny_family_model
from test_engine_numerics import PROMPTS, assert_matches_hf, engine_for

from asyncrl.configs import ConfigError
from asyncrl.configs.schema import EmbeddedRolloutConfig, PolicyConfig
from asyncrl.policy.mtp import check_plain_head
from asyncrl.policy.validate import check_policy_directory
from asyncrl.records import SamplingParams
from asyncrl.rollout import EmbeddedEngine
from asyncrl.rollout.fp8 import Fp8Error
from asyncrl.rollout.models.generic import TransformersModel
from asyncrl.rollout.models.gqa import GqaModel
from asyncrl.rollout.scoring import NativeScorer


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_samples_with_transformers_log_probs(family):
    model = tiny_family_model(family)
    engine = engine_for(model)
    assert type(engine.model).__name__ == NATIVE.get(family, "TransformersModel")
    params = SamplingParams(temperature=0.7, max_tokens=12, seed=3)
    # Ragged prompts prefilled together, then decoded together; then a second turn reusing the first's KV.
    results = run_to_completion(engine, [(p, params) for p in PROMPTS])
    (first,) = run_to_completion(engine, [(PROMPTS[0], params)], session_id="s")
    (second,) = run_to_completion(engine, [(first.prompt_token_ids + first.token_ids + [7, 8], params)], session_id="s")
    assert second.cached_prompt_tokens > len(PROMPTS[0])
    assert all(len(r.token_ids) == 12 for r in [*results, first, second])
    assert_matches_hf(model, [*results, first, second], temperature=0.7)
    engine.shutdown()


def test_llama_with_biases_and_llama3_rope_scaling_runs_natively():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}  # fmt: skip
    model = tiny_family_model("llama")
    config = model.config
    config.attention_bias, config.mlp_bias, config.rope_parameters = True, True, rope
    biased = type(model)(config).eval()
    biased.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        for name, param in biased.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.3)
    engine = engine_for(biased)
    assert isinstance(engine.model, GqaModel)
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=5)
    assert_matches_hf(biased, run_to_completion(engine, [(p, params) for p in PROMPTS]))
    engine.shutdown()


@pytest.mark.parametrize(
    ("family", "fields"), [("llama", {"hidden_act": "gelu"}), ("deepseek_v3", {"q_lora_rank": None})], ids=["gelu-mlp", "no-query-latent"]
)
def test_a_variant_the_native_forward_lacks_runs_on_the_generic_path(family, fields):
    model = tiny_family_model(family, **fields)
    engine = engine_for(model)
    assert isinstance(engine.model, TransformersModel)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=4)
    assert_matches_hf(model, run_to_completion(engine, [(p, params) for p in PROMPTS]))
    engine.shutdown()


def test_glm4_moe_without_qk_norm_or_biases_and_with_grouped_routing_runs_natively():
    model = tiny_family_model("glm4_moe", use_qk_norm=False, attention_bias=False, n_routed_experts=8, n_group=2, topk_group=1)
    engine = engine_for(model)
    assert type(engine.model).__name__ == "GqaModel" and engine.model.rotary_dim == 8  # half of each 16-wide head
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=6)
    assert_matches_hf(model, run_to_completion(engine, [(p, params) for p in PROMPTS]))
    engine.shutdown()


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_native_moe_families_run_fp8_weights_and_record_routes(family):
    engine = EmbeddedEngine(tiny_family_model(family), EmbeddedRolloutConfig(max_num_seqs=2, fp8=True, record_routes=True))
    (result,) = run_to_completion(engine, [(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=5, seed=1))])
    assert engine.model.fp8 and len(result.token_ids) == 5
    assert len(result.routes) == 5 and all(len(step) == 1 and len(step[0]) == 2 for step in result.routes)  # one MoE layer, top-2
    engine.shutdown()


def test_generic_path_chunked_prefill_scoring_and_weight_updates_match_transformers():
    model = tiny_family_model("gpt2")
    engine = EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=4, prefill_chunk_tokens=16))
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=1)
    long_prompt = list(range(30, 90))  # prefilled in four pieces
    assert_matches_hf(model, run_to_completion(engine, [(long_prompt, params)]))
    scorer = NativeScorer(model)
    assert isinstance(scorer.model, TransformersModel)
    scored = torch.tensor(scorer.score([long_prompt])[0][1:])
    with torch.no_grad():
        logits = model(torch.tensor([long_prompt])).logits[0, :-1]
    expected = logits.log_softmax(-1).gather(1, torch.tensor(long_prompt[1:])[:, None]).squeeze(1)
    assert (scored - expected).abs().max() < 1e-4
    # A push: the engine samples from the new weights, and its old weights are gone.
    updated = tiny_family_model("gpt2", seed=7)
    engine.update_weights(updated.state_dict(), version=1)
    (result,) = run_to_completion(engine, [(PROMPTS[0], params)])
    assert result.versions == [1] * 6
    assert_matches_hf(updated, [result])
    engine.shutdown()


def _tiny(family: str, **fields):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, **fields)  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (lambda: _tiny("cohere"), r"cohere: transformers' forward through the engine's cache differs from its own full forward"),
        (
            lambda: _tiny("mamba", state_size=4),
            r"mamba: layers of kinds \['linear_attention'\]; the embedded engine runs attention layers only",
        ),
        (
            lambda: _tiny("mistral", num_key_value_heads=2, sliding_window=16),
            r"mistral: sliding_window=16, below the engine's context \(64\)",
        ),
    ],
    ids=["scaled-logits", "recurrent", "sliding-window"],
)
def test_what_the_engine_cannot_run_exactly_is_refused_at_start(model, match):
    with pytest.raises(ValueError, match=match):
        EmbeddedEngine(model(), EmbeddedRolloutConfig(max_num_seqs=2, max_model_len=64))


def test_generic_path_refuses_fp8_and_mtp_drafting():
    model = tiny_family_model("gpt2")
    with pytest.raises(Fp8Error, match=r"gpt2\) runs no FP8 weights; only native families do"):
        EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=2, fp8=True))
    with pytest.raises(ValueError, match=r"rollout.mtp_drafting: gpt2 runs on the generic transformers path"):
        EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=2, mtp_drafting=True), mtp={})


def test_the_learner_refuses_a_family_that_scales_its_logits():
    with pytest.raises(ValueError, match=r"policy.path: cohere does more to its logits"):
        check_plain_head(_tiny("cohere"))
    check_plain_head(tiny_family_model("gpt2"))  # tied embeddings, another decoder name: a plain head


def test_the_learner_refuses_a_head_that_is_no_linear_layer():
    model = tiny_family_model("llama")
    model.set_output_embeddings(torch.nn.Sequential(model.get_output_embeddings()))  # the same logits, another module
    with pytest.raises(ValueError, match=r"policy.path: llama's output head is a Sequential, not a linear layer"):
        check_plain_head(model)


def test_a_checkpoint_directory_of_each_kind_passes_the_start_up_check(tmp_path):
    for family in ("llama", "gpt2"):
        check_policy_directory(PolicyConfig(path=str(save_family_checkpoint(family, tmp_path / family))))


@pytest.mark.parametrize(
    ("spoil", "match"),
    [
        (lambda d: (d / "config.json").unlink(), r"policy.path: .* is not a model directory \(no config.json\)"),
        (lambda d: (d / "model.safetensors").unlink(), r"policy.path: .* has no weights"),
        (
            lambda d: (d / "config.json").write_text('{"model_type": "vit"}'),
            r"policy.path: .* holds a 'vit' model, which is not a causal LM",
        ),
        (lambda d: (d / "config.json").write_text("{not json"), r"policy.path: .*config.json does not load"),
        (lambda d: _edit_config(d, vocab_size=100), r"policy.path: the tokenizer has \d+ tokens but the model's vocab_size is 100"),
        (lambda d: _drop_template(d), r"policy.path: the tokenizer in .* has no chat template; set policy.chat_template"),
    ],
    ids=["no-config", "no-weights", "not-causal", "bad-json", "vocab-mismatch", "no-template"],
)
def test_bad_policy_directories_are_refused_naming_the_key(tmp_path, spoil, match):
    directory = save_family_checkpoint("llama", tmp_path / "ckpt")
    spoil(directory)
    with pytest.raises(ConfigError, match=match):
        check_policy_directory(PolicyConfig(path=str(directory)))


def test_a_template_file_supplies_a_missing_chat_template(tmp_path):
    from asyncrl.policy.checkpoint import load_policy

    directory = save_family_checkpoint("llama", tmp_path / "ckpt")
    template = _drop_template(directory)
    path = tmp_path / "template.jinja"
    path.write_text(template)
    check_policy_directory(PolicyConfig(path=str(directory), chat_template=str(path)))
    _, tokenizer, _ = load_policy(directory, chat_template=str(path))
    assert tokenizer.chat_template == template
    (tmp_path / "plain.txt").write_text("no jinja here")
    with pytest.raises(ConfigError, match=r"policy.chat_template: .*plain.txt holds no Jinja"):
        check_policy_directory(PolicyConfig(path=str(directory), chat_template=str(tmp_path / "plain.txt")))


def _edit_config(directory, **changes) -> None:
    import json

    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _drop_template(directory) -> str:
    """Remove the tokenizer's chat template from the directory; returns it."""
    import json

    template = ""
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        path = directory / name
        if name.endswith(".jinja") and path.exists():
            template = path.read_text()
            path.unlink()
        elif path.exists():
            config = json.loads(path.read_text())
            template = config.pop("chat_template", None) or template
            path.write_text(json.dumps(config))
    assert template
    return template


def test_a_family_without_an_mtp_layer_runs_without_one_unless_the_config_asks(tmp_path):
    from asyncrl.configs import load_config
    from asyncrl.policy.checkpoint import build_policy
    from asyncrl.policy.validate import resolve_policy

    gpt2 = save_family_checkpoint("gpt2", tmp_path / "gpt2")
    with pytest.warns(UserWarning, match=r"policy.mtp.enabled: asyncrl cannot build an MTP layer for gpt2 .*goes on without one"):
        settled = resolve_policy(load_config("quickstart", [f"policy.path={gpt2}"]).policy)
    assert not settled.mtp.enabled and build_policy(settled, 0)[2] is None
    asked = load_config("quickstart", [f"policy.path={gpt2}", "policy.mtp.enabled=true"]).policy
    with pytest.raises(ConfigError, match=r"cannot build an MTP layer for gpt2 .*set policy.mtp.enabled=false"):
        resolve_policy(asked)
    with pytest.raises(ConfigError, match=r"cannot build an MTP layer for gpt2 .*set policy.mtp.enabled=false"):
        build_policy(asked, 0)
    llama = load_config("quickstart", [f"policy.path={save_family_checkpoint('llama', tmp_path / 'llama')}"]).policy
    assert resolve_policy(llama) == llama and build_policy(llama, 0)[2] is not None  # a fresh layer
    # An RL run that neither trains nor drafts with it gets none; one that asks for it keeps it.
    assert not resolve_policy(llama, mtp_used=False).mtp.enabled
    asked = load_config("quickstart", [f"policy.path={llama.path}", "policy.mtp.enabled=true"]).policy
    assert resolve_policy(asked, mtp_used=False).mtp.enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: nothing is lost
        assert not resolve_policy(load_config("quickstart", [f"policy.path={gpt2}"]).policy, mtp_used=False).mtp.enabled
