"""Start-up checks of a policy directory: refused with the key and the problem before any actor starts.

`check_policy_directory` reads only config.json, the tokenizer files and the names of the weight
files, so it costs well under a second even for a large checkpoint; what needs the weights (the
family's head, `mtp.check_plain_head`; the engine's path, `rollout/models`) is checked where they load.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from asyncrl.configs.loader import ConfigError
from asyncrl.configs.models import CATALOG
from asyncrl.configs.schema import PolicyConfig

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def read_chat_template(path: str, key: str = "policy.chat_template") -> str:
    """The Jinja text of the template file `path` (relative paths also beside the shipped presets:
    `configs/templates/...`)."""
    from asyncrl.configs.paths import data_path

    try:
        template = data_path(path).read_text()
    except OSError as err:
        raise ConfigError(f"{key}: cannot read {path}: {err.strerror}") from err
    if "{%" not in template and "{{" not in template:
        raise ConfigError(f"{key}: {path} holds no Jinja ({{% ... %}} or {{{{ ... }}}}): it is not a chat template")
    return template


def check_policy_directory(policy: PolicyConfig, key: str = "policy.path") -> PretrainedConfig | None:
    """ConfigError naming `key` when `policy.path` cannot be the policy: not a directory with config.json,
    not a causal LM, no weights, a tokenizer that does not load, has more tokens than the model's
    vocabulary, or has no chat template while `policy.chat_template` gives none. Returns the model's config
    (None for the tiny policy)."""
    if policy.path is None:
        return None
    directory = Path(policy.path)
    if policy.path in CATALOG and not directory.exists():
        raise ConfigError(f"{key}: {policy.path} is not fetched yet: run `asyncrl model fetch {policy.path}` first")
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{key}: {directory} is not a model directory (no config.json)")
    try:
        config = AutoConfig.from_pretrained(str(directory))
    except (ValueError, OSError, KeyError) as err:
        raise ConfigError(f"{key}: {directory}/config.json does not load: {err}") from err
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"{key}: {directory} holds a {config.model_type!r} model, which is not a causal LM (no AutoModelForCausalLM)")
    if not any(next(directory.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise ConfigError(f"{key}: {directory} has no weights (*.safetensors or *.bin)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except (ValueError, OSError, KeyError, TypeError) as err:
        raise ConfigError(f"{key}: the tokenizer in {directory} does not load: {err}") from err
    if len(tokenizer) > config.vocab_size:
        raise ConfigError(
            f"{key}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {config.vocab_size}: "
            "they are not from the same checkpoint (ids past the vocabulary have no embedding)"
        )
    if policy.chat_template is not None:
        read_chat_template(policy.chat_template)
    elif not tokenizer.chat_template:
        raise ConfigError(
            f"{key}: the tokenizer in {directory} has no chat template; set policy.chat_template to a Jinja file "
            "(the gateway renders every conversation with it)"
        )
    return config


def resolve_policy(policy: PolicyConfig, *, mtp_used: bool = True) -> PolicyConfig:
    """`policy` checked (`check_policy_directory`) and settled for the run's config. For a checkpoint without an
    MTP layer, with MTP on by default (not set in the config):

    - a fresh layer is left out when nothing would use it (`mtp_used` False: an RL run that neither trains
      it, `learner.mtp_loss_weight`, nor drafts with it): an untrained extra decoder layer, saved with
      copies of the embedding and head in every checkpoint, costs memory and disk for nothing;
    - a family asyncrl cannot build one for runs without one, with a warning.

    Asked for explicitly, MTP is kept, or refused (ConfigError) where it cannot be built. The run directory
    keeps the settled config, so every process that reads it agrees."""
    config = check_policy_directory(policy)
    if config is None or not policy.mtp.enabled:
        return policy
    from .checkpoint import has_mtp_layer, mtp_unsupported

    if has_mtp_layer(str(policy.path), config.model_type):
        return policy
    explicit = "enabled" in policy.mtp.model_fields_set
    off = policy.model_copy(update={"mtp": policy.mtp.model_copy(update={"enabled": False})})
    if not mtp_used and not explicit:
        return off
    if (problem := mtp_unsupported(config)) is None:
        return policy
    if explicit:
        raise ConfigError(f"{problem}; set policy.mtp.enabled=false")
    warnings.warn(f"{problem}; the run goes on without one (policy.mtp.enabled=false)", stacklevel=2)
    return off
