"""Native forward passes of the model families the embedded engine runs, built from HF weights."""

from __future__ import annotations

import torch

from .glm_moe_dsa import GlmMoeDsaModel
from .qwen3 import Qwen3Model

ARCHITECTURES = {"glm_moe_dsa": GlmMoeDsaModel, "qwen3": Qwen3Model}
"""transformers model_type -> native implementation. Other families need the vLLM backend."""


def build_model(config, state_dict: dict, *, max_len: int, dtype: torch.dtype, device: torch.device, fp8: bool = False):
    """The native model for a transformers config and its (transformers-named) state dict.

    With `fp8`, its linear weights are stored as float8_e4m3fn (`rollout/fp8.py`); a model that
    cannot be quantized raises `Fp8Error` here, at start-up.
    """
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ValueError(
            f"the embedded engine has no native forward for model_type {config.model_type!r}; "
            f"supported: {', '.join(sorted(ARCHITECTURES))} (use rollout.type='vllm' for others)"
        )
    return arch(config, state_dict, max_len=max_len, dtype=dtype, device=device, fp8=fp8)
