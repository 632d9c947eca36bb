"""The embedded engine's model for a transformers config: a native forward where the family has one,
transformers' own forward over the engine's cache (`generic.py`) for any other causal LM."""

from __future__ import annotations

import logging

import torch

from .common import NativeUnsupported
from .generic import TransformersModel
from .glm_moe_dsa import GlmMoeDsaModel
from .gqa import GqaModel

log = logging.getLogger(__name__)

ARCHITECTURES = {
    "glm_moe_dsa": GlmMoeDsaModel,
    "deepseek_v3": GlmMoeDsaModel,
    **dict.fromkeys(("llama", "qwen2", "mistral", "qwen3", "glm4_moe"), GqaModel),
}
"""transformers model_type -> native implementation; other families, and variants a native one refuses
(`NativeUnsupported`), run through `TransformersModel`."""


def build_model(config, state_dict: dict, *, max_len: int, dtype: torch.dtype, device: torch.device, fp8: bool = False):
    """The model for a transformers config and its (transformers-named) state dict: the family's native
    forward, or else transformers' own (a log line says which runs).

    With `fp8`, its linear weights are stored as float8_e4m3fn (`rollout/fp8.py`); a model that
    cannot be quantized (every family without a native forward) raises `Fp8Error` here, at start-up.
    """
    arch = ARCHITECTURES.get(config.model_type)
    if arch is not None:
        try:
            native = arch(config, state_dict, max_len=max_len, dtype=dtype, device=device, fp8=fp8)
        except NativeUnsupported as why:
            log.info("embedded engine: %s", why)
        else:
            log.info("embedded engine: native forward for %s", config.model_type)
            return native
    return TransformersModel(config, state_dict, max_len=max_len, dtype=dtype, device=device, fp8=fp8)
