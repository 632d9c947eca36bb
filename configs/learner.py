"""The learner section and the optimizer it (and SFT) steps with."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .section import Section


class OptimizerConfig(Section):
    """The optimizer of a training section (learner, sft); its learning rate and weight decay are the section's own
    `lr` and `weight_decay`. adamw: AdamW on every parameter. muon: torch's Muon (orthogonalized momentum) on the
    hidden weight matrices, each MoE expert's matrix on its own, and AdamW on embeddings, the LM head, norms,
    biases, router gates and the DSA indexer's head weights. muon_split: as muon, but each attention head's
    slice of a multi-head projection (q/k/v/o, MLA's q_b/kv_b, the indexer's wq_b) is orthogonalized on its own."""

    type: Literal["adamw", "muon", "muon_split"] = "adamw"
    """adamw (every parameter), muon (orthogonalized updates for hidden matrices) or muon_split (per attention head)."""
    momentum: float = Field(0.95, ge=0.0, lt=1.0)
    """Muon: momentum of the gradient buffer that is orthogonalized."""
    nesterov: bool = True
    """Muon: orthogonalize the Nesterov look-ahead (gradient + momentum x buffer) instead of the buffer."""
    ns_steps: int = Field(5, ge=1, le=99)
    """Muon: Newton-Schulz iterations per orthogonalization (torch's quintic coefficients)."""
    adjust_lr_fn: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Muon: update scale per matrix (per head block under muon_split): match_rms_adamw (0.2 sqrt(max(rows, cols)),
    so the section's AdamW lr and weight decay carry over) or original (sqrt(max(1, rows/cols)), Keller Jordan's)."""
    adamw_lr: float | None = Field(None, gt=0, le=1.0)
    """muon / muon_split: learning rate of the AdamW group (embeddings, LM head, norms, biases, gates); None: the
    section's lr."""
    ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Muon: precision of the Newton-Schulz iterations. bfloat16 is torch.optim.Muon's; auto is float32 on a CPU,
    where bfloat16 matmuls are emulated (13x slower than float32 on the 2-core benchmark machine), else bfloat16."""


class LearnerConfig(Section):
    """The RL learner: objective, drop and group rules, optimizer, weight pushes (docs/LEARNER.md, "The rules")."""

    objective: Literal["icepop_grpo", "double_sided_is"] = "icepop_grpo"
    """GRPO with the IcePop mask (reasoning default) or direct double-sided importance sampling (agentic default)."""
    eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower ratio bound 1 - eps_low: PPO clip (icepop_grpo) or hard token mask (double_sided_is)."""
    eps_high: float = Field(0.28, ge=0.0, le=10.0)
    """Upper ratio bound 1 + eps_high: PPO clip (icepop_grpo) or hard token mask (double_sided_is)."""
    icepop_beta: float = Field(2.0, gt=1.0, le=100.0)
    """IcePop: tokens whose train/rollout probability ratio lies outside [1/beta, beta] give no gradient."""
    group_size: int = Field(8, ge=1, le=1024)
    """Rollouts per GRPO group (one prompt, group_size samples)."""
    normalize_adv_std: bool = True
    """Divide group-centred rewards by the group's standard deviation."""
    max_staleness: int = Field(4, ge=0)
    """tau: drop a rollout when learner version - oldest version among its sampled tokens > tau."""
    crash_statuses: list[Literal["env_crash", "timeout", "error"]] = ["env_crash", "error"]
    """Finish statuses that count as environment crashes and are dropped."""
    lr: float = Field(1e-4, gt=0, le=1.0)
    """Learning rate (AdamW's; Muon's too under muon / muon_split; 3e-4 was unstable on the tiny policy with AdamW)."""
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    """Decoupled weight decay (AdamW's, and Muon's under muon / muon_split)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """adamw, muon or muon_split, with Muon's knobs (lr and weight_decay above)."""
    batch_groups: int = Field(32, ge=1, le=65536)
    """GRPO groups per optimizer step."""
    push_every: int = Field(1, ge=1)
    """K: publish weights to the rollout workers every K optimizer steps."""
    reset_optimizer_on_push: bool = False
    """Clear the optimizer's moments (AdamW's, Muon's momentum buffers) after each weight push."""
    mtp_loss_weight: float = Field(0.0, ge=0.0, le=10.0)
    """Weight of the MTP auxiliary loss on sampled tokens during RL (keeps drafting accurate); 0 turns it off."""
    freeze_indexer: bool = True
    """Keep the DSA indexer's weights fixed during RL (the GLM-5 report saw collapse when it drifted)."""
    torch_threads: int = Field(1, ge=1, le=256)
    """torch intra-op threads in the learner process."""
    num_cpus: float = Field(1.0, gt=0.0)
    """Ray CPU resources of the learner actor (of each rank's, with num_ranks > 1)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the learner computes; auto picks cuda when its process sees a GPU (a whole GPU per rank is asked of Ray
    when this is cuda, or auto on a cluster with GPUs, unless gpus_per_rank says otherwise)."""
    gpus_per_rank: float = Field(0.0, ge=0.0)
    """Ray GPU resources of each learner rank; 0: one whole GPU each when the learner runs on CUDA, none on CPU."""
    num_ranks: int = Field(1, ge=1, le=1024)
    """Data-parallel learner processes (learner/distributed.py): each computes a share of every step's rows
    and the gradients are summed over a torch.distributed group (gloo on CPU); the result is the one-rank step's."""
    sharding: Literal["auto", "replicate", "fsdp"] = "auto"
    """How num_ranks > 1 hold the policy (learner/sharding.py): replicate (every rank the whole policy and optimizer,
    gradients summed: DDP's semantics) or fsdp (torch's FSDP2 `fully_shard`: each rank a 1/num_ranks shard of the
    weights, gradients and optimizer state, for a model that does not fit one device). auto: fsdp when the
    learner runs on CUDA, else replicate."""
    micro_batch_tokens: int = Field(8192, ge=1)
    """Most padded tokens (rows x longest) in one forward/backward; bounds activation memory."""
    share_prefixes: bool = True
    """Score the tokens that rows begin with in common (a GRPO group's prompt) once per micro-batch, not once per
    row (learner/prefix.py): the same log-probs and gradients for fewer tokens. Applies where the policy's family
    gives the same logits both ways (checked at start; a warning says when not) and not with routing_replay,
    gradient_checkpointing or fsdp sharding, which score whole rows."""
    logits_chunk_tokens: int = Field(2048, ge=1)
    """Most positions whose full-vocabulary logits exist at once. The head (the MTP layer's loss's too) runs only
    where a token is trained, into one float32 buffer of this many positions at most (2048 x 151,936 words:
    1.2 GB); a micro-batch with more trained tokens is scored chunk by chunk, each chunk's logits recomputed in
    the backward pass instead of kept (asyncrl/policy/token_logprobs.py), for one more head matmul."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them: activation memory
    of one layer instead of all, for about a third more compute (a model too big for its device at micro_batch_tokens)."""
    checkpoint_every: int = Field(50, ge=1)
    """Save an HF checkpoint plus learner state every this many optimizer steps."""
    keep_checkpoints_every: int | None = Field(None, ge=1)
    """Checkpoint retention: keep the checkpoints whose version is a multiple of this, plus the last
    `keep_last_checkpoints`, and delete the others once a newer one is on disk (None: keep every one)."""
    keep_last_checkpoints: int = Field(2, ge=1, le=100000)
    """The newest checkpoints always kept (with keep_checkpoints_every set); resume needs the last one."""
    logprob_gap_warning: float = Field(0.5, gt=0.0)
    """Warn when, in a step, the mean |learner - rollout| log-prob of a task's (or a turn index's) sampled
    tokens exceeds this: the learner and the engines no longer compute the same policy."""
    routing_replay: bool = False
    """MoE policies: the learner's forward uses the experts the engine chose for each sampled token
    (recorded with rollout.record_routes) instead of routing again, so router near-ties cannot split them."""
