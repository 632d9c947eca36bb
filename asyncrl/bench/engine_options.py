"""`asyncrl bench engine`'s own settings (`bench.KEY=VALUE`), apart from the bench so the registry imports no torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.configs.schema import Section

BATCH = 64
PROMPT_TOKENS = 32
REPEATS = 3


class EngineBenchOptions(Section):
    """Settings of `asyncrl bench engine` itself (`bench.KEY=VALUE` on the command line)."""

    model: Literal["auto", "tiny", "checkpoint"] = "auto"
    """What the engine side measures: auto = policy.path unless it is an SFT checkpoint with an MTP layer (then the tiny
    policy, and MTP/FP8 on the checkpoint), the tiny policy without policy.path."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype under test, on every side (bfloat16 only with CPU bf16 instructions or a GPU)."""
    batch: int = Field(BATCH, ge=1)
    """Requests at once in the batched measurements (tok_s_b64, prefill, vLLM)."""
    new_tokens: int | None = Field(None, ge=1)
    """New tokens per request; None: 128 on the tiny policy, 64 on a checkpoint."""
    prompt_tokens: int = Field(PROMPT_TOKENS, ge=1)
    """Random prompt length on the tiny policy (a checkpoint's prompts are its chat template's)."""
    repeats: int = Field(REPEATS, ge=1)
    """Timed runs of each measurement after its warm-up; medians reported."""
    group_size: int = Field(8, ge=1)
    """Requests of the GRPO group in prefill_tokens_per_group."""
    max_model_len: int = Field(512, ge=16)
    """vLLM's max_model_len, and the engine's on a checkpoint unless rollout.max_model_len is set (at most the model's)."""
    matmul_size: int = Field(2048, ge=16)
    """Side of the square matmul of the matmul limit."""
    hf_generate: bool = True
    """Measure transformers' generate() too."""
    vllm: bool = True
    """Measure vLLM too, where its environment exists."""
    vllm_python: str | None = None
    """The vLLM environment's python (None: $ASYNCRL_VLLM_VENV/bin/python, else the repository's .venv-vllm)."""
    vllm_kv_cache_gb: int = Field(4, ge=1)
    """VLLM_CPU_KVCACHE_SPACE for the vLLM side (GiB), unless the environment sets it."""
