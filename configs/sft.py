"""The SFT warm start's section: its data, its schedule and the sparse-attention indexer warm-up."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .learner import OptimizerConfig
from .section import Section


class SFTDataConfig(Section):
    """Chat-format rows to train on (`sft.data`): one conversation per row, loss on assistant tokens only."""

    path: str | None = None
    """A JSONL file, a Parquet file or a Hugging Face `datasets` directory (`save_to_disk`) of rows with a
    messages column (OpenAI chat format, tool calls and tool results included); None: demonstrations only."""
    messages_column: str = Field("messages", min_length=1)
    """Column holding each row's list of messages."""
    tools_column: str = Field("tools", min_length=1)
    """Column holding each row's tool definitions (OpenAI format); optional in the file."""
    fraction: float = Field(1.0, gt=0.0, le=1.0)
    """Share of each step's conversations drawn from the file; the rest are built-in demonstrations (their own mix)."""
    heldout_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of rows held out for the held-out loss, chosen by a hash of each conversation (stable across runs)."""
    eval_path: str | None = None
    """A file of held-out rows (same format and columns) instead of heldout_fraction."""
    heldout_max_rows: int = Field(256, ge=1)
    """Held-out rows scored at each evaluation (`eval_loss` in metrics.jsonl)."""
    max_length: int = Field(2048, ge=8, le=1 << 20)
    """Longest conversation in tokens (longer rows are skipped and counted); with packing, the length of a packed row."""
    packing: bool = False
    """Pack several conversations into each row of a micro-batch, each attending only to its own tokens."""
    on_malformed: Literal["skip", "refuse"] = "skip"
    """A malformed row (bad JSON, missing messages, an unknown role, no assistant message, too long) is counted and
    skipped, or refused at start-up."""

    @model_validator(mode="after")
    def _check_heldout(self) -> SFTDataConfig:
        if self.eval_path is not None and self.heldout_fraction > 0:
            raise ValueError("set sft.data.eval_path or sft.data.heldout_fraction, not both")
        if self.path is None and self.eval_path is not None:
            raise ValueError("sft.data.eval_path needs sft.data.path (the rows to train on)")
        return self


class IndexerWarmupConfig(Section):
    """DSA indexer warm-up after SFT (glm_moe_dsa only; learner/indexer_warmup.py): the dense stage trains only the
    indexers, each to match its layer's head-averaged attention by KL, the policy frozen; the sparse stage then
    trains with each indexer's top-k selection in effect, the indexers by KL on their selected positions and
    everything else by the SFT loss. Both run after the SFT loop, before the final evaluation and the save."""

    steps: int = Field(0, ge=0)
    """Dense warm-up optimizer steps (0: no warm-up)."""
    sparse_steps: int = Field(0, ge=0)
    """Sparse adaptation steps after the dense ones (0: none)."""
    lr: float = Field(1e-3, gt=0, le=1.0)
    """AdamW learning rate of the indexers' own optimizer (both stages); the rest keeps the SFT optimizer's."""
    batch_size: int = Field(32, ge=1, le=4096)
    """Conversations per warm-up step (both stages)."""
    sparse_index_topk: int | None = Field(None, ge=1)
    """Key positions each query keeps in the sparse stage; None: the policy's index_topk. Set it below the SFT
    conversations' length where they are shorter than index_topk, or the selection keeps every position."""


class SFTConfig(Section):
    """Supervised warm start on demonstrations of the built-in tasks and, with `data.path`, on chat rows from a file."""

    max_steps: int = Field(3000, ge=1)
    """Hard cap on optimizer steps."""
    time_budget_s: float = Field(270.0, gt=0)
    """Stop after this many seconds of training even if no other stop rule fired."""
    batch_size: int = Field(128, ge=1, le=4096)
    """Demonstrations per optimizer step."""
    lr: float = Field(1e-3, gt=0, le=1.0)
    """Peak learning rate (every group's; `optimizer.adamw_lr` sets the AdamW group's under muon / muon_split)."""
    warmup_steps: int = Field(50, ge=0)
    """Linear learning-rate warm-up."""
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    """Decoupled weight decay (AdamW's, and Muon's under muon / muon_split)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """adamw, muon or muon_split, with Muon's knobs (lr and weight_decay above)."""
    tool_demo_fraction: float = Field(0.05, ge=0.0, le=1.0)
    """Share of demonstrations that show the agentic tool-call format (a python tool call and its answer)."""
    general_demo_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of demonstrations of the general task (an instruction and an answer meeting its constraints);
    with tool_demo_fraction at most 1."""
    eval_every: int = Field(50, ge=1)
    """Evaluate held-out accuracy every this many steps."""
    stop_at_accuracy: float | None = Field(0.3, ge=0.0, le=1.0)
    """Stop at the first evaluation at or above this held-out accuracy (leaves room for RL); None disables."""
    task: str | None = None
    """A task of `tasks.mix` whose environment's demonstrations replace the arithmetic ones and whose held-out split
    SFT is scored on (e.g. a reasoning_gym task); None: the built-in reasoning task."""
    data: SFTDataConfig = SFTDataConfig()
    """Chat rows from a file, mixed with the demonstrations by `data.fraction`."""
    indexer_warmup: IndexerWarmupConfig = IndexerWarmupConfig()
    """DSA indexer warm-up (dense, then sparse) after the SFT loop; off unless `steps` or `sparse_steps` is set."""

    @model_validator(mode="after")
    def _check_fractions(self) -> SFTConfig:
        if self.tool_demo_fraction + self.general_demo_fraction > 1.0:
            raise ValueError("tool_demo_fraction + general_demo_fraction must not exceed 1")
        return self
