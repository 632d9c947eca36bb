"""The policy section: the checkpoint (or the tiny policy the project builds) and its MTP layer."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from .models import resolve_model_path
from .section import Section


class TinyModelConfig(Section):
    """Shape of the embedded tiny policy that asyncrl builds when no model directory is given."""

    arch: Literal["glm_moe_dsa", "qwen3"] = "glm_moe_dsa"
    """transformers model family: GLM-5's (MLA + DSA indexer + MoE) or a dense Qwen3."""
    hidden_size: int = Field(128, ge=16, le=8192)
    """Width of the residual stream."""
    num_layers: int = Field(4, ge=1, le=64)
    """Number of decoder layers (the MTP layer comes on top of these)."""
    num_heads: int = Field(4, ge=1, le=128)
    """Attention heads (key/value heads equal heads)."""
    intermediate_size: int = Field(256, ge=16)
    """Hidden width of the dense MLP layers."""
    moe_intermediate_size: int = Field(64, ge=8)
    """Hidden width of each routed and shared expert (glm_moe_dsa only)."""
    num_experts: int = Field(4, ge=1, le=256)
    """Routed experts per MoE layer (glm_moe_dsa only)."""
    experts_per_token: int = Field(2, ge=1)
    """Routed experts chosen per token by the sigmoid router (glm_moe_dsa only)."""
    first_dense_layers: int = Field(1, ge=0)
    """Leading layers with a dense MLP instead of MoE (glm_moe_dsa only)."""
    kv_lora_rank: int = Field(64, ge=8)
    """MLA compressed key/value width (glm_moe_dsa only)."""
    q_lora_rank: int = Field(64, ge=8)
    """MLA compressed query width (glm_moe_dsa only)."""
    qk_rope_head_dim: int = Field(16, ge=2)
    """Rotary part of each query/key head (glm_moe_dsa only); even."""
    qk_nope_head_dim: int = Field(32, ge=1)
    """Non-rotary part of each query/key head (glm_moe_dsa only)."""
    v_head_dim: int = Field(32, ge=1)
    """Value head width (glm_moe_dsa only)."""
    index_topk: int = Field(256, ge=1)
    """DSA: key positions each query may attend to, chosen by the indexer (glm_moe_dsa only)."""
    index_heads: int = Field(2, ge=1)
    """DSA indexer heads (glm_moe_dsa only)."""
    index_head_dim: int = Field(32, ge=2)
    """DSA indexer head width (glm_moe_dsa only); at least qk_rope_head_dim."""
    max_position_embeddings: int = Field(512, ge=16)
    """Longest context the model supports, prompt plus completion."""

    @model_validator(mode="after")
    def _check_shapes(self) -> TinyModelConfig:
        if self.experts_per_token > self.num_experts:
            raise ValueError("experts_per_token must not exceed num_experts")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError("index_head_dim must be at least qk_rope_head_dim")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        return self


class MTPConfig(Section):
    """The multi-token-prediction module (GLM-5 / DeepSeek-V3 shape) trained beside the policy."""

    enabled: bool = True
    """Build, train and save the MTP layer."""
    train_depth: int = Field(1, ge=1, le=8)
    """Depths 1..D at which the one shared MTP layer is unrolled in training (depth k predicts token t+k+1)."""
    depth_weights: list[Annotated[float, Field(ge=0.0)]] | None = None
    """lambda_1..lambda_D of L_MTP = sum_k lambda_k CE_k, one per depth; None weighs every depth 1/D."""
    loss_weight: float = Field(0.3, ge=0.0, le=10.0)
    """Weight of the MTP auxiliary loss relative to the next-token loss."""

    @model_validator(mode="after")
    def _check_depth_weights(self) -> MTPConfig:
        if self.depth_weights is not None:
            if len(self.depth_weights) != self.train_depth:
                raise ValueError(
                    f"depth_weights has {len(self.depth_weights)} entries, train_depth is {self.train_depth}: give one weight per depth"
                )
            if not sum(self.depth_weights) > 0:
                raise ValueError("depth_weights must not all be 0 (set loss_weight to 0 to turn the MTP loss off)")
        return self

    def weights_per_depth(self) -> list[float]:
        """lambda_k for k = 1..train_depth: `depth_weights`, or 1/D each (the mean over depths, as in DeepSeek-V3)."""
        return list(self.depth_weights) if self.depth_weights is not None else [1.0 / self.train_depth] * self.train_depth


class PolicyConfig(Section):
    """Which model is the policy."""

    path: str | None = None
    """A Hugging Face causal-LM directory (config, safetensors, tokenizer), or the name of a model
    `asyncrl model fetch` has fetched (smollm2-135m); None builds the tiny policy. Checked at start-up
    (`asyncrl/policy/validate.py`): a causal LM, with weights, a tokenizer no larger than its vocabulary
    and a chat template."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The policy's dtype in the embedded engines (the learner keeps float32 weights: `learner.precision`);
    auto: the checkpoint's own (config.json's)."""
    chat_template: str | None = None
    """A Jinja chat template file for a tokenizer that has none (or to replace its own)."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the tiny policy built when `path` is None."""
    mtp: MTPConfig = MTPConfig()
    """The MTP module."""

    @field_validator("path")
    @classmethod
    def _fetched_model(cls, path: str | None) -> str | None:
        return None if path is None else resolve_model_path(path)
