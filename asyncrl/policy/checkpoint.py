"""Policy checkpoints: Hugging Face directories that transformers and vLLM load as they are.

Layout of a saved directory:

- `config.json`, `generation_config.json`, `model.safetensors`: written by `save_pretrained`, so
  `AutoModelForCausalLM.from_pretrained(dir)` loads the policy offline. With an MTP layer,
  config.json also says `num_nextn_predict_layers: 1`.
- tokenizer files: `AutoTokenizer.from_pretrained(dir)` gives the char-level tokenizer and its
  chat template.
- `mtp.safetensors`: the MTP layer as `model.layers.{N}.*` (N = num_hidden_layers), named the way
  the released DeepSeek-V3 / GLM checkpoints name it and vLLM's deepseek_mtp / glm4_moe_mtp loaders
  read it: `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, the decoder block's own parameters
  directly under the layer (vLLM moves them under `mtp_block`), experts one by one
  (`mlp.experts.{e}.gate_proj.weight`, as `save_pretrained` writes the policy's), plus copies of the
  policy's embedding and LM head as `embed_tokens.weight` and `shared_head.head.weight`. Older vLLM
  releases load those two copies into the drafter; newer ones share the target's and skip them.
  vLLM reads every `*.safetensors` of an unsharded directory and its main-model loader skips
  layers at index >= num_hidden_layers, while transformers reads only `model.safetensors`, so the
  policy loads without a wall of "unexpected key" warnings. A sharded policy (an index file) gets
  the MTP keys added to the index, because vLLM then reads only the files the index names.
- For families without a DeepSeek-style MTP loader in vLLM (the dense Qwen3 fallback), the MTP file
  goes to `mtp/mtp.safetensors` instead: vLLM's Qwen3 loader would reject the extra layer.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.core_model_loading import revert_weight_conversion
from transformers.utils import logging as hf_logging

from asyncrl.configs.loader import ConfigError
from asyncrl.configs.schema import PolicyConfig

from .mtp import MTPLayer, build_mtp
from .tiny import build_tiny_model
from .tokenizer import build_tokenizer

MTP_FILE = "mtp.safetensors"
INDEX_FILE = "model.safetensors.index.json"
VLLM_MTP_FAMILIES = frozenset({"glm_moe_dsa", "glm4_moe", "deepseek_v3", "deepseek_v2"})
"""model_type values whose vLLM implementation loads `model.layers.{N}.*` as an MTP drafter."""
_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
_OWN_MODULES = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _mtp_path(directory: Path, model_type: str) -> Path:
    return directory / (MTP_FILE if model_type in VLLM_MTP_FAMILIES else f"mtp/{MTP_FILE}")


def has_mtp_layer(directory: str | Path, model_type: str) -> bool:
    """Whether a checkpoint directory carries an MTP layer as `save_policy` writes it."""
    return _mtp_path(Path(directory), model_type).exists()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No progress bars or info chatter from transformers while saving or loading a tiny model."""
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def mtp_state_dict(
    model: PreTrainedModel, mtp: MTPLayer, whole: tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]] | None = None
) -> dict[str, torch.Tensor]:
    """The MTP layer under its on-disk names (`model.layers.{N}.*`, experts unfused). `whole`: the policy's and
    the MTP layer's state dicts to take the tensors from, where the modules hold shards (a sharded learner's)."""
    prefix = f"model.layers.{mtp.layer_index}."
    policy_state, own = whole if whole is not None else (model.state_dict(), mtp.state_dict())
    state = {prefix + name.removeprefix("block."): t for name, t in own.items()}
    names = {id(module): name for name, module in model.named_modules()}
    state[prefix + "embed_tokens.weight"] = policy_state[f"{names[id(model.get_input_embeddings())]}.weight"]
    state[prefix + "shared_head.head.weight"] = policy_state[f"{names[id(model.get_output_embeddings())]}.weight"]
    # transformers' own inverse of its load-time conversion, so the block's experts are named
    # exactly as save_pretrained names the policy's layers.
    state = revert_weight_conversion(model, state)
    return {name: t.detach().contiguous().cpu() for name, t in state.items()}


def _fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert weights back into the 3D `gate_up_proj` / `down_proj` tensors the module holds."""
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    fused = {}
    for name, tensor in state.items():
        match = _EXPERT_KEY.match(name)
        if match:
            experts[match[1]][match[3]][int(match[2])] = tensor
        else:
            fused[name] = tensor
    for base, parts in experts.items():
        count = len(parts["down_proj"])
        gate_up = [torch.cat([parts["gate_proj"][e], parts["up_proj"][e]], dim=0) for e in range(count)]
        fused[f"{base}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{base}.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(count)])
    return fused


def _load_mtp(model: PreTrainedModel, path: Path) -> MTPLayer:
    mtp = build_mtp(model)
    prefix = f"model.layers.{mtp.layer_index}."
    state = {}
    for name, tensor in load_file(str(path)).items():
        local = name.removeprefix(prefix)
        if local in _SHARED_COPIES:
            continue  # the policy's own embedding and head are the ones used
        state[local if local.startswith(_OWN_MODULES) else "block." + local] = tensor
    mtp.load_state_dict(_fuse_experts(state), strict=True)
    return mtp.eval()


def _update_config(directory: Path, changes: dict, drop: tuple[str, ...] = ()) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    for key in drop:
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_policy(
    directory: str | Path,
    model: PreTrainedModel,
    tokenizer,
    mtp: MTPLayer | None = None,
    extra_config: dict | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    mtp_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the policy (and MTP layer, if any) as a Hugging Face directory; returns its path.

    `extra_config` keys are merged into config.json (e.g. asyncrl provenance: stage, step). `state_dict` and
    `mtp_state`: the weights to write instead of the modules' own (a sharded learner's, gathered whole).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with _quiet():
        # A copy: save_pretrained drops the tied head's entry from the dict it is given.
        model.save_pretrained(str(directory), state_dict=None if state_dict is None else dict(state_dict))
        tokenizer.save_pretrained(str(directory))
    if mtp is None:
        _update_config(directory, extra_config or {}, drop=("num_nextn_predict_layers",))
        return directory
    _update_config(directory, {**(extra_config or {}), "num_nextn_predict_layers": 1})
    path = _mtp_path(directory, model.config.model_type)
    path.parent.mkdir(exist_ok=True)
    state = mtp_state_dict(model, mtp, None if state_dict is None or mtp_state is None else (state_dict, mtp_state))
    save_file(state, str(path), metadata={"format": "pt"})
    index = directory / INDEX_FILE
    if path.parent == directory and index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({name: MTP_FILE for name in state})
        index.write_text(json.dumps(data, indent=2) + "\n")
    return directory


DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""`policy.dtype` -> what `from_pretrained` takes."""


def load_policy(
    directory: str | Path, dtype: str = "auto", chat_template: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, MTPLayer | None]:
    """(model, tokenizer, MTP layer or None) from a directory written by `save_policy`.

    Any Hugging Face causal-LM directory works too; it simply has no MTP layer. `dtype`: a
    `policy.dtype` name (auto: the checkpoint's); `chat_template`: a Jinja file replacing the
    tokenizer's template (`policy.chat_template`).
    """
    directory = Path(directory)
    with _quiet():
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=DTYPES[dtype])
    if chat_template is not None:
        from .validate import read_chat_template

        tokenizer.chat_template = read_chat_template(chat_template)
    path = _mtp_path(directory, model.config.model_type)
    mtp = _load_mtp(model, path) if path.exists() else None
    return model, tokenizer, mtp


def build_policy(policy: PolicyConfig, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, MTPLayer | None]:
    """The tiny policy, freshly initialised, when `policy.path` is None; else the checkpoint there
    (`policy.dtype`, `policy.chat_template` applied).

    A checkpoint without an MTP layer gets a fresh one when MTP is enabled; with MTP disabled
    none is returned.
    """
    tokenizer: PreTrainedTokenizerBase
    if policy.path is None:
        dtype = torch.float32 if policy.dtype == "auto" else DTYPES[policy.dtype]
        model, tokenizer, mtp = build_tiny_model(policy.tiny, seed=seed, dtype=dtype), build_tokenizer(), None
    else:
        model, tokenizer, mtp = load_policy(policy.path, policy.dtype, policy.chat_template)
    if not policy.mtp.enabled:
        return model, tokenizer, None
    if mtp is None:
        mtp = _fresh_mtp(model, policy, seed + 1)
    return model, tokenizer, mtp


def _fresh_mtp(model: PreTrainedModel, policy: PolicyConfig, seed: int) -> MTPLayer:
    """A new MTP layer for a policy that has none; ConfigError for a family it cannot be built for (GPT-2, Phi:
    no `model.layers` of RMSNorm decoder blocks). `validate.resolve_policy` turns the default off for those first."""
    try:
        return build_mtp(model, seed=seed)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{mtp_unsupported(model.config)}; set policy.mtp.enabled=false") from err


def mtp_unsupported(config) -> str | None:
    """Why asyncrl cannot build an MTP layer for a model of this config, or None when it can (tried on the meta
    device: no memory, no weights)."""
    import torch

    try:
        with torch.device("meta"):
            build_mtp(AutoModelForCausalLM.from_config(config))
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        return f"policy.mtp.enabled: asyncrl cannot build an MTP layer for {config.model_type} ({type(err).__name__}: {err})"
    return None
